"""Rule rewards against hand-checked answers: equivalent forms must match, near misses must not."""

import pytest

from slime_hydra.reward import get_reward_fn
from slime_hydra.reward.f1 import token_f1

MATH = [  # (response, label, expected)
    ("The answer is \\boxed{\\frac{1}{2}}", "1/2", 1), ("so \\boxed{0.5}", "\\frac{1}{2}", 1),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", 1), ("\\boxed{\\frac12}", "1/2", 1), ("\\boxed{1,000}", "1000", 1),
    ("\\boxed{1000}", "1,000", 1), ("\\boxed{-3}", "-3", 1), ("\\boxed{3}", "-3", 0), ("\\boxed{12}", "21", 0),
    ("\\boxed{0.51}", "1/2", 0), ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1), ("\\boxed{\\sqrt{4}}", "2", 1),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", 0), ("\\boxed{x^2+2x+1}", "(x+1)^2", 1),
    ("\\boxed{x^2+1}", "(x+1)^2", 0), ("\\boxed{(1, 2]}", "(1,2]", 1), ("\\boxed{[1, 2]}", "(1,2]", 0),
    ("\\boxed{50\\%}", "50\\%", 1), ("\\boxed{5 \\text{ cm}}", "5", 1), ("\\boxed{90^\\circ}", "90", 1),
    ("\\boxed{\\pi}", "\\pi", 1), ("\\boxed{3.14}", "\\pi", 0), ("first \\boxed{1} then \\boxed{2}", "2", 1),
    ("first \\boxed{1} then \\boxed{2}", "1", 0), ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1),
    ("\\fbox{7}", "7", 1), ("The answer is 42.", "42", 1), ("Answer: 17", "17", 1), ("I think 5 then 6", "6", 1),
    ("I think 5 then 6", "5", 0), ("no answer here", "3", 0), ("", "3", 0), ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1),
    ("\\boxed{\\{1,3\\}}", "\\{1,2\\}", 0), ("\\boxed{2/4}", "1/2", 1), ("\\boxed{1.50}", "1.5", 1),
    ("\\boxed{0.333}", "1/3", 0), ("\\boxed{10^{3}}", "1000", 1), ("\\boxed{e^{0}}", "1", 1),
    ("\\boxed{1,000,000}", "1000000", 1), ("\\boxed{\\$5}", "5", 1), ("\\boxed{45^{\\circ}}", "45", 1),
    ("\\boxed{\\left[2, 5\\right)}", "[2,5)", 1), ("\\boxed{x=3}", "3", 1), ("\\boxed{-\\frac{1}{2}}", "-0.5", 1),
    ("\\boxed{\\frac{-1}{2}}", "0.5", 0), ("\\boxed{12 \\text{ cm}^2}", "12", 1),
    ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1), ("\\boxed{\\frac{3}{4}}", "0.75", 1),
    ("\\boxed{\\frac{3}{4}}", "0.74", 0), ("46", "46", 1), ("47", "46", 0),
]

DAPO = [  # (response, label, expected correct)
    ("Answer: 42", "42", True), ("Answer: $42$", "42", True), ("answer: 42.", "42", True),
    ("Answer: \\boxed{42}", "42", True), ("Answer: 1,000", "1000", True), ("Answer: 1000", "1,000", True),
    ("Answer: 5 cm", "5", True), ("Answer: 90^\\circ", "90", True), ("Answer: 90°", "90", True),
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", True), ("Answer: \\frac{1}{2}", "\\tfrac{1}{2}", True),
    ("Answer: 0.50", "0.5", True), ("Answer: .5", "0.5", True), ("Answer: \\text{yes}", "yes", True),
    ("Answer: 50\\%", "50", True), ("Answer: 5 units", "5", True), ("Answer: -7", "-7", True),
    ("Answer: x^2", "x^2", True), ("Answer: \\left(1,2\\right)", "(1,2)", True), ("Answer: 42\nmore text", "42", True),
    ("Answer: 1\nAnswer: 2", "2", True), ("reasoning... ANSWER: 12", "12", True), ("Answer:   8  ", "8", True),
    ("Answer: $\\boxed{3}$", "3", True), ("Answer: 3 dollars", "3", True),
    ("Answer: 43", "42", False), ("Answer: 7", "-7", False), ("Answer: 0.51", "0.5", False),
    ("42", "42", False), ("The answer is 42", "42", False),
    ("Answer:", "42", False), ("Answer: 1\nAnswer: 2", "1", False),
    ("Answer: x^3", "x^2", False), ("Answer: (1,2)", "[1,2]", False), ("Answer: 12", "21", False),
    ("Answer: 1000", "100", False), ("Answer: no", "yes", False), ("", "1", False), ("Answer: 4.2", "42", False),
    ("Answer: \\frac{1}{3}", "\\frac{1}{2}", False), ("answer 42", "42", False),
]

DEEPSCALER = [  # (response, label, expected)
    ("<think>try 3</think> so \\boxed{4}", "4", 1), ("<think>\\boxed{4}</think> \\boxed{5}", "4", 0),
    ("<think>\\boxed{4}</think> \\boxed{5}", "5", 1),
    ("\\boxed{4}", "4", 0), ("<think>x</think>The answer is 7", "7", 1),
    ("<think>x</think>\\boxed{\\frac{1}{2}}", "0.5", 1), ("<think>x</think>\\boxed{0.5}", "1/2", 1),
    ("<think>x</think>\\boxed{\\dfrac12}", "\\frac{1}{2}", 1), ("<think>x</think>\\boxed{1,000}", "1000", 1),
    ("<think>x</think>\\boxed{\\sqrt{4}}", "2", 1), ("<think>x</think>\\boxed{\\sqrt{5}}", "2", 0),
    ("<think>x</think>\\boxed{-1}", "1", 0), ("<think>x</think>\\boxed{(0,1)}", "(0,1)", 1),
    ("<think>x</think>\\boxed{[0,1)}", "(0,1)", 0), ("<think>x</think>\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1),
    ("<think>x</think>\\boxed{1.5707}", "\\frac{\\pi}{2}", 0), ("<think>x</think>", "3", 0),
    ("<think>a</think><think>b</think>\\boxed{9}", "9", 1), ("<think>x</think>\\boxed{2x}", "2x", 1),
    ("<think>x</think>\\boxed{x2}", "x^2", 0), ("</think>\\boxed{8}", "8", 1), ("<think>\\boxed{8}", "8", 0),
    ("<think>x</think>\\boxed{10}", "10.0", 1), ("<think>x</think>\\boxed{10.01}", "10", 0),
    ("<think>x</think>\\boxed{3/6}", "1/2", 1), ("<think>x</think>\\boxed{4/6}", "1/2", 0),
    ("<think>x</think>\\boxed{12}", "21", 0), ("<think>x</think>\\boxed{\\{1,2\\}}", "\\{1,2\\}", 1),
    ("<think>x</think>\\boxed{25\\%}", "25\\%", 1), ("<think>x</think>\\boxed{e}", "e", 1),
    ("<think>x</think>\\boxed{2.718}", "e", 0),
    ("<think>x</think>I get 6", "6", 1), ("<think>x</think>I get 6", "7", 0),
    ("<think>x</think>\\boxed{7\\text{ m}}", "7", 1), ("<think>x</think>\\boxed{30^\\circ}", "30", 1),
    ("<think>x</think>\\boxed{-0}", "0", 1), ("<think>x</think>\\boxed{100}", "10^2", 1),
    ("<think>x</think>\\boxed{101}", "10^2", 0), ("<think>x</think>\\boxed{\\frac{2}{3}}", "0.6667", 0),
    ("<think>x</think>Answer: 13", "13", 1), ("no think at all 13", "13", 0),
]


@pytest.mark.parametrize("response,label,expected", MATH)
def test_math(response, label, expected):
    assert get_reward_fn("math")(response, label, {}) == expected


@pytest.mark.parametrize("response,label,expected", DAPO)
def test_dapo(response, label, expected):
    out = get_reward_fn("dapo")(response, label, {})
    assert out["acc"] is expected and out["score"] == (1.0 if expected else -1.0) and isinstance(out["pred"], str)


@pytest.mark.parametrize("response,label,expected", DEEPSCALER)
def test_deepscaler(response, label, expected):
    assert get_reward_fn("deepscaler")(response, label, {}) == expected


def test_at_least_40_cases_per_math_style_reward():
    assert min(len(MATH), len(DAPO), len(DEEPSCALER)) >= 40


@pytest.mark.parametrize("prediction,reference,expected", [
    ("the cat sat", "cat sat", 1.0),                       # articles dropped
    ("cat sat on mat", "cat sat", 2 * 0.5 * 1.0 / 1.5),      # p = 2/4, r = 2/2
    ("a dog", "the cat", 0.0),
    ("Paris, France!", "paris france", 1.0),                # case and punctuation
    ("red red blue", "red blue blue", 2 * (2 / 3) * (2 / 3) / (4 / 3)),  # multiplicity: common = 2
])
def test_f1(prediction, reference, expected):
    assert token_f1(prediction, reference) == pytest.approx(expected, abs=1e-9)


def test_f1_takes_the_best_reference():
    assert get_reward_fn("f1")("cat sat", ["dog", "cat sat"], {}) == 1.0


@pytest.mark.parametrize("response,label,expected", [
    ("Answer: C", "C", 1), ("The answer is (B).", "B", 1), ("\\boxed{D}", "D", 1), ("I pick (A)", "A", 1),
    ("so it is B", "B", 1), ("Answer: C", 2, 1),
    ("Answer: C", 1, 0), ("Answer: A", "C", 0), ("(A) or (B)? (B)", "B", 1),
    ("answer: **D**", "D", 1), ("no idea", "A", 0), ("Answer: (J)", "J", 1), ("\\boxed{(E)}", "E", 1),
    ("The answer is C", "(C)", 1), ("The answer is C", "D", 0), ("the answer is a tricky one: (C)", "C", 1),
    ("Answer: B", "b", 1),
])
def test_gpqa(response, label, expected):
    assert get_reward_fn("gpqa")(response, label, {}) == expected


def test_random_is_deterministic_and_fair():
    fn = get_reward_fn("random")
    values = [fn(f"r{i}", None, {"seed": 3}) for i in range(1000)]
    assert values == [fn(f"r{i}", None, {"seed": 3}) for i in range(1000)]
    assert set(values) == {0.0, 1.0} and 0.45 < sum(values) / 1000 < 0.55


def test_exact_match():
    fn = get_reward_fn("exact_match")
    assert fn(" 46 ", "46", {}) == 1.0 and fn("46", "47", {}) == 0.0


@pytest.mark.parametrize("name,nearest", [("maht", "math"), ("dapo_", "dapo"), ("deepscalar", "deepscaler"),
                                          ("exactmatch", "exact_match"), ("remot", "remote")])
def test_unknown_name_names_the_key_the_choices_and_the_nearest(name, nearest):
    with pytest.raises(ValueError, match=rf"reward.name='{name}' is not a reward; choose one of math, .*custom; "
                                         rf"did you mean '{nearest}'"):
        get_reward_fn(name)


def scaled(response, label, metadata):
    return 0.5 * float(response == label)


def test_custom_target_and_its_errors():
    assert get_reward_fn("custom", "tests.reward.test_rule_rewards.scaled")("x", "x", {}) == 0.5
    with pytest.raises(ValueError, match="reward.target='no.such.module.fn' cannot be imported"):
        get_reward_fn("custom", "no.such.module.fn")
    with pytest.raises(ValueError, match="reward.target='tests.reward.test_rule_rewards.nothing' cannot be imported"):
        get_reward_fn("custom", "tests.reward.test_rule_rewards.nothing")
    with pytest.raises(ValueError,
                       match="reward.target='tests.reward.test_rule_rewards.MATH' is a list, not a callable"):
        get_reward_fn("custom", "tests.reward.test_rule_rewards.MATH")
    with pytest.raises(ValueError, match="needs reward.target"):
        get_reward_fn("custom")
