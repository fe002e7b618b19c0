"""The generated environments: deterministic rows, disjoint held-out splits, scores, and the countdown checker."""

from fractions import Fraction

import pytest

from slime_hydra.data.config import MAX_LEVELS
from slime_hydra.data.tasks import get_env, get_task, task_reward
from slime_hydra.data.tasks.countdown import InvalidExpression, answer_of, check, value

ENVS = sorted(MAX_LEVELS)


@pytest.mark.parametrize("name", ENVS)
def test_rows_are_fixed_by_seed_and_level(name):
    env = get_env(name)
    a = env.rows("train", seed=5, levels=[1, 2], n=50)
    assert a == env.rows("train", seed=5, levels=[1, 2], n=50) != env.rows("train", seed=6, levels=[1, 2], n=50)
    assert [r["metadata"]["level"] for r in a[:4]] == [1, 2, 1, 2]                # levels round robin
    assert {r["metadata"]["task"] for r in a} == {name}
    assert env.draw(1, 7, 2) == env.draw(1, 7, 2) != env.draw(1, 8, 2)             # the k-th draw: (seed, k, level)
    assert env.draw(1, 7, 2)["metadata"]["level"] == 2


@pytest.mark.parametrize("name", ENVS)
def test_held_out_split_is_disjoint_from_train_and_draws(name):
    env = get_env(name)
    levels = range(1, env.max_level + 1)
    held = {r["prompt"] for r in env.rows("eval", levels=levels, n=300)}
    train = {r["prompt"] for r in env.rows("train", seed=3, levels=levels, n=2000)}
    drawn = {env.draw(9, k, 1 + k % env.max_level)["prompt"] for k in range(500)}
    assert held and not held & train and not held & drawn
    assert all(env.held_out(p) for p in held) and not any(env.held_out(p) for p in train | drawn)
    assert env.rows("eval", seed=1, n=20) == env.rows("eval", seed=2, n=20)       # every run evaluates the same


@pytest.mark.parametrize("name", ENVS)
def test_every_solution_scores_one_and_a_wrong_answer_zero(name):
    env = get_env(name)
    rows = env.rows("train", seed=0, levels=range(1, env.max_level + 1), n=200)
    assert all(task_reward(env.solution(r["label"], r["metadata"]), r["label"], r["metadata"]) == 1.0 for r in rows)
    assert all(task_reward("12345678901", r["label"], r["metadata"]) == 0.0 for r in rows)
    sft = env.sft_rows(30, seed=2)
    assert len(sft) == 30 and sft == env.sft_rows(30, seed=2) and not any(env.held_out(r["prompt"]) for r in sft)


def test_levels_set_the_difficulty():
    arithmetic = get_env("arithmetic")
    assert arithmetic.draw(0, 1, 1)["prompt"] == "9-6=" and arithmetic.draw(0, 1, 1)["label"] == "3"
    assert arithmetic.draw(0, 5, 5)["prompt"] == "276+525*570=" and arithmetic.draw(0, 5, 5)["label"] == "299526"
    counts = [len(get_env("countdown").draw(0, 0, level)["metadata"]["numbers"]) for level in range(1, 6)]
    assert counts == [2, 3, 4, 5, 6]
    sorting = [get_env("sorting").draw(0, 3, level)["metadata"]["values"] for level in (1, 5, 10)]
    assert [len(v) for v in sorting] == [3, 7, 12] and max(sorting[0]) <= 9 and max(sorting[2]) <= 999
    assert get_env("sorting").draw(0, 3, 1)["label"] == " ".join(map(str, sorted(sorting[0])))


@pytest.mark.parametrize("response,label,expected", [
    ("7 19 41", "7 19 41", 1.0), (" 7  19\n41 ", "7 19 41", 1.0), ("7 41 19", "7 19 41", 0.0),
    ("7 19", "7 19 41", 0.0), ("7,19,41", "7 19 41", 0.0)])
def test_sorting_score(response, label, expected):
    assert get_task("sorting").score(response, label) == expected


@pytest.mark.parametrize("response,expected", [
    ("<calc>12*34</calc><result>408</result>408", 1.0), ("408", 1.0), ("<calc>12*34</calc><result>408</result>", 0.0),
    ("<calc>12*34</calc><result>408</result>409", 0.0), ("<calc>1</calc><result>1</result>408 ", 1.0)])
def test_calculator_score_reads_the_answer_after_the_last_tool_result(response, expected):
    assert get_task("calculator").score(response, "408") == expected


def test_calculator_tool_computes_every_label_and_is_the_tasks_hook():
    from slime_hydra.dotted import import_callable
    from slime_hydra.rollout.examples.calculator_tool import run_calculator

    env = get_env("calculator")
    assert callable(import_callable(env.generate_hook, "generate_hook", "the calculator's generate hook"))
    for r in env.rows("train", levels=range(1, env.max_level + 1), n=60):
        assert run_calculator(r["metadata"]["expression"]) == r["label"]  # the tool computes the label exactly


NUMBERS = [3, 7, 25, 2]
@pytest.mark.parametrize("expression", ["3*25-7+2", "2+3*25-7", "((25*3)-7)+2", "3*25+2-7", "(25+7+3)*2",
                                        "2*(3+7+25)", " 3 * 25 - 7 + 2 "])
def test_countdown_accepts_valid_expressions(expression):
    assert check(expression, NUMBERS, 70)


def test_countdown_accepts_every_valid_expression_of_a_problem():
    """Every expression over subsets of the numbers, each at most once, with + - * / and any bracketing: the
    checker accepts exactly those whose exact value is the target (brute force, exact fractions)."""
    numbers, target = [2, 3, 4], 10

    def exprs(items):
        if len(items) == 1:
            yield str(items[0]), Fraction(items[0])
            return
        for split in range(1, len(items)):
            for left, a in exprs(items[:split]):
                for right, b in exprs(items[split:]):
                    yield f"({left}+{right})", a + b
                    yield f"({left}-{right})", a - b
                    yield f"({left}*{right})", a * b
                    if b != 0:
                        yield f"({left}/{right})", a / b

    from itertools import permutations
    right = wrong = 0
    for k in range(1, 4):
        for items in permutations(numbers, k):
            for text, v in exprs(list(items)):
                assert value(text, numbers) == v
                assert check(text, numbers, target) == (v == target)
                right += v == target
                wrong += v != target
    assert right == 6 and wrong == 213  # (2*3)+4, (3*2)+4, 4+(2*3), 4+(3*2), (4*3)-2, (3*4)-2: all accepted


def test_countdown_is_exact():
    assert value("7/2*2", [7, 2, 2]) == 7 and check("7/2*2", [7, 2, 2], 7)
    assert value("1/3+1/3+1/3", [1, 3, 1, 3, 1, 3]) == Fraction(1)


@pytest.mark.parametrize("expression,reason", [
    ("3*25-7+5", "not a given number"),                  # 5 is not given
    ("3*25-7+2+2", "used more often"),                   # 2 reused
    ("25*3-3", "used more often"),
    ("__import__('os').system('true')", "Call"),
    ("(lambda: 70)()", "Call"),
    ("x", "Name"),
    ("25.0*3", "Constant"),
    ("-2+7*25/3", "UnaryOp"),
    ("3**2", "BinOp"),
    ("7//2", "BinOp"),
    ("25/(7-7)", "used more often"),
    ("25/(3-3)", "used more often"),
    ("True+2", "Constant"),
    ("", "empty"),
    ("3*" + "(" * 150 + "2" + ")" * 150, "longer than"),
    ("3 *", "not an expression"),
])
def test_countdown_rejects(expression, reason):
    with pytest.raises(InvalidExpression, match=reason):
        value(expression, NUMBERS)
    assert not check(expression, NUMBERS, 70)


def test_countdown_division_by_zero_is_wrong():
    with pytest.raises(InvalidExpression, match="division by zero"):
        value("7/(3-3)", [7, 3, 3])
    assert not check("7/(3-3)", [7, 3, 3], 0)


def test_countdown_answer_is_the_last_line_before_an_equals_sign():
    assert answer_of("let me think\n(25-7)*3+2=56\n") == "(25-7)*3+2"
    env = get_env("countdown")
    meta = {"numbers": NUMBERS, "target": 70}
    assert env.score("3*25-7+2 = 70", "70", meta) == 1.0 and env.score("3*25-7+2", "71", meta) == 0.0
    assert env.score("__import__('os')", "70", meta) == 0.0


def test_task_reward_needs_a_generated_row():
    with pytest.raises(ValueError, match="metadata"):
        task_reward("46", "46", {"a": 12, "b": 34})


def test_eval_rows_are_distinct_and_a_small_level_gives_fewer():
    env = get_env("arithmetic")
    rows = env.rows("eval", levels=[1, 2], n=100)
    levels = [r["metadata"]["level"] for r in rows]
    assert len({r["prompt"] for r in rows}) == len(rows) and levels.count(2) == 50
    held_one_digit = {f"{a}{op}{b}=" for a in range(10) for b in range(10) for op in "+-"}
    held_one_digit = {p for p in held_one_digit if env.held_out(p)}
    assert {r["prompt"] for r in rows if r["metadata"]["level"] == 1} == held_one_digit and len(held_one_digit) == 26
