"""The rank harness fails fast: a rank that dies without reporting (a signal, a crash below Python) or that fails
before its function runs fails the test with its rank and exit code, instead of leaving it waiting forever."""

import os
import signal

import pytest

from tests.train.harness import run_ranks


def _rank1_killed(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _rank0_raises(rank, world):
    if rank == 0:
        raise ValueError("boom")
    return rank


def test_a_rank_killed_without_a_word_fails_the_call():
    with pytest.raises(RuntimeError, match=r"ranks died without a result: rank 1 exit code -9"):
        run_ranks(2, _rank1_killed)


def test_a_rank_that_raises_reports_its_error_and_ranks_that_finish_return():
    with pytest.raises(RuntimeError, match=r"rank 0: ValueError\('boom'\)"):
        run_ranks(2, _rank0_raises)
    assert run_ranks(2, _own_rank) == [0, 1]


def _own_rank(rank, world):
    return rank
