"""The learner's DataLoader settings ([learner] num_workers, prefetch_factor, persistent_workers, pin_memory): their
defaults, where they come from, and the values refused with the setting named."""

from __future__ import annotations

import pytest

from learner.config import LearnerSettings, PinMemory
from stream.errors import ConfigError
from streamrec.settings import Sources


def test_the_defaults_read_in_the_training_process_and_pin_only_on_cuda() -> None:
    ls = LearnerSettings()
    assert (ls.num_workers, ls.prefetch_factor, ls.persistent_workers, ls.pin_memory) == (0, 4, False, PinMemory.AUTO)
    assert ls.pin_memory.resolve("cuda") is True and ls.pin_memory.resolve("cpu") is False


@pytest.mark.parametrize(("text", "member"), [("on", PinMemory.ON), ("true", PinMemory.ON), ("off", PinMemory.OFF),
                                              ("False", PinMemory.OFF), ("auto", PinMemory.AUTO)])
def test_pin_memory_reads_words_and_booleans(text: str, member: PinMemory) -> None:
    assert LearnerSettings(pin_memory=text).pin_memory is member  # type: ignore[arg-type]


def test_pin_memory_on_without_cuda_is_refused_naming_the_setting() -> None:
    assert PinMemory.OFF.resolve("cuda") is False
    assert PinMemory.ON.resolve("cuda") is True
    with pytest.raises(ConfigError, match=r"\[learner\] pin_memory = on needs CUDA"):
        PinMemory.ON.resolve("cpu")


@pytest.mark.parametrize("bad, message", [({"num_workers": -1}, r"num_workers must be an integer >= 0, got -1"),
                                          ({"prefetch_factor": 0}, r"prefetch_factor must be an integer >= 1, got 0")])
def test_negative_workers_or_no_prefetch_are_refused(bad: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=r"\[learner\] " + message):
        LearnerSettings(**bad)  # type: ignore[arg-type]


def test_the_settings_come_from_the_file_and_the_environment_over_it() -> None:
    src = Sources(file_data={"learner": {"num_workers": 1, "prefetch_factor": 8, "pin_memory": True}},
                  environ={"STREAMREC_LEARNER_NUM_WORKERS": "2", "STREAMREC_LEARNER_PERSISTENT_WORKERS": "true",
                           "STREAMREC_LEARNER_PIN_MEMORY": "off"})
    ls = src.build(LearnerSettings, "learner")
    assert (ls.num_workers, ls.prefetch_factor, ls.persistent_workers, ls.pin_memory) == (2, 8, True, PinMemory.OFF)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_future_ts_s_must_be_a_finite_number_of_seconds_at_least_0(bad: float) -> None:
    with pytest.raises(ConfigError, match="future_ts_s must be a finite number of seconds >= 0"):
        LearnerSettings(future_ts_s=bad)
