"""algo=opd's teacher before anything starts (config/files.check_teacher, the memory plan): it must be a conf/model
option or a complete checkpoint, read the student's tokens, and split as the student splits; the memory plan counts
its weights in every trainer rank, as many as the checkpoint holds."""

import pytest
from transformers import AutoModelForCausalLM

from slime_hydra.config.memory import plan_memory
from slime_hydra.model.config import ModelConfig
from slime_hydra.model.hf import build_random_checkpoint
from slime_hydra.model.teacher import teacher_option
from slime_hydra.model.tiny import build_tiny_tokenizer
from tests.config.helpers import load
from tests.config.test_preflight import only, preflight

OPD = ("algo=opd",)


def _checkpoint(root, name: str, tokenizer=None, **fields):
    """A random tiny-shaped checkpoint (fields override tiny's), with the tiny tokenizer or none."""
    model = ModelConfig(**{**ModelConfig().__dict__, "tokenizer": None, **fields})
    kwargs = {}
    if tokenizer is not None:
        kwargs = dict(tokenizer=tokenizer, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None)
    return build_random_checkpoint(model, root / name, seed=0, **kwargs)


def test_the_cpu_recipes_teacher_is_valid_and_read_off_its_option():
    assert preflight("recipes=tiny_opd_cpu") == []
    teacher = teacher_option("tiny_teacher")
    assert (teacher.name, teacher.tokenizer, teacher.sft_warm_start_steps) == ("tiny_teacher", "char", 1500)


def test_a_teacher_that_is_neither_an_option_nor_a_checkpoint_is_refused(tmp_path):
    only(preflight(*OPD, f"algo.teacher.path={tmp_path}/none"), "algo.teacher.path", "neither a conf/model option")
    only(preflight(*OPD, "algo.teacher.path=tiny_techer"), "algo.teacher.path", "tiny_teacher")  # the options listed


def test_a_checkpoint_teacher_of_a_built_student_must_have_its_character_tokenizer(tmp_path):
    """model=tiny is built with the character tokenizer: a checkpoint of it (a run's export) can teach it, one with
    another vocabulary cannot."""
    from transformers import PreTrainedTokenizerFast

    same = _checkpoint(tmp_path, "same", build_tiny_tokenizer())
    assert preflight(*OPD, f"algo.teacher.path={same}") == []
    other = PreTrainedTokenizerFast.from_pretrained(str(same))
    other.add_tokens(["<tool>"])
    text = only(preflight(*OPD, f"algo.teacher.path={_checkpoint(tmp_path, 'other', other)}"), "algo.teacher.path",
                "tokens map to different ids")
    assert "'<tool>': None vs 101" in text


def test_teacher_and_student_checkpoints_of_different_eos_are_refused(tmp_path):
    from transformers import PreTrainedTokenizerFast

    student = _checkpoint(tmp_path, "s", build_tiny_tokenizer())
    other = PreTrainedTokenizerFast.from_pretrained(str(student))
    other.eos_token = other.pad_token
    teacher = _checkpoint(tmp_path, "t", other)
    only(preflight(*OPD, f"model.path={student}", f"algo.teacher.path={teacher}"), "algo.teacher.path",
         "eos_token_id is")
    assert preflight(*OPD, f"model.path={student}", f"algo.teacher.path={student}") == []  # itself: valid


def test_built_teacher_and_student_of_different_tokenizer_kinds_are_refused():
    text = only(preflight(*OPD, "algo.teacher.path=small"), "algo.teacher.path", "the teacher builds a bpe tokenizer")
    assert "the student a char one" in text


def test_megatron_refuses_a_teacher_it_cannot_split_as_the_student(tmp_path):
    student, tok = tmp_path / "s", build_tiny_tokenizer()
    _checkpoint(tmp_path, "s", tok)
    teacher = _checkpoint(tmp_path, "t", tok, num_attention_heads=6, num_kv_heads=3, hidden_size=96)
    only(preflight(*OPD, f"model.path={student}", f"algo.teacher.path={teacher}", "train=megatron", "train.tp=2",
                   "train.num_gpus=2"), "algo.teacher.path", "do not split over train.tp=2")


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_the_memory_plan_counts_every_teacher_weight_in_each_trainer_rank(tmp_path, backend):
    """On a CPU-only machine: the teacher's fp32 weights, as many parameters as its checkpoint holds, whole in one
    rank (FSDP dp 1, megatron tp 1); within 0.1%: config/memory.param_counts gives each layer's norms 4H, where
    Qwen2 has 2H (2,304 of 2.39M here)."""
    teacher = _checkpoint(tmp_path, "t", build_tiny_tokenizer(), num_layers=6, hidden_size=192, ffn_hidden_size=512,
                          num_attention_heads=6, num_kv_heads=2)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher).parameters())
    cfg, d = load(*OPD, f"algo.teacher.path={teacher}", f"train={backend}")
    host = plan_memory(cfg, d).host.parts["trainer ranks"]
    cfg_none, d_none = load(f"train={backend}")
    teacher_bytes = host - plan_memory(cfg_none, d_none).host.parts["trainer ranks"]
    assert teacher_bytes == pytest.approx(4 * params, rel=1e-3)
    assert params > 2_000_000  # a teacher larger than the 0.8M student
