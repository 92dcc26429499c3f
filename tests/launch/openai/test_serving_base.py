"""Admission (serving_base.py): no request while stopping, at most max_waiting without
their first token, and a started request frees its place once."""

from __future__ import annotations

import pytest

from launch.openai.protocol import APIError
from launch.openai.serving_base import Admission, checked_truncation


def test_admission_bounds_the_requests_waiting_for_their_first_token() -> None:
    admission = Admission(max_waiting=1)
    admission.check_room()
    first = admission.admit()
    with pytest.raises(APIError) as refused:
        admission.check_room()
    assert refused.value.status == 503 and refused.value.code == "too_many_waiting_requests"
    assert "--max-waiting-requests 1" in refused.value.message
    first.started()
    first.started()  # a second call frees nothing more
    assert admission.num_waiting == 0
    admission.check_room()


def test_a_stopping_server_admits_nothing_and_no_bound_admits_all() -> None:
    admission = Admission()
    for _ in range(100):
        admission.check_room()
        admission.admit()
    admission.check_open()
    admission.draining = True
    with pytest.raises(APIError) as refused:
        admission.check_open()
    assert refused.value.status == 503 and refused.value.code == "server_shutting_down"


def test_truncate_prompt_tokens_is_checked_before_any_prompt_is_cut() -> None:
    assert checked_truncation(None) is None and checked_truncation(5) == 5
    with pytest.raises(APIError) as bad:
        checked_truncation(0)
    assert bad.value.param == "truncate_prompt_tokens"
