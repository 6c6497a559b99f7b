"""The dense part's precision (``[learner] amp``): bf16 autocast only where the CPU computes bf16 natively.

An AVX2-only CPU emulates bf16 matmuls (38 ms against 1.3 ms in fp32 for a 256x400 @ 400x400 here), which made
the daemon train at 1.5 k samples/s where the same model in fp32 trains several times faster.
"""

from __future__ import annotations

import pytest
import torch

from learner.config import Amp, LearnerSettings
from learner.model import autocast_dtype, native_cpu_bf16
from stream.errors import ConfigError
from streamrec.settings import Sources


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, None)])
def test_auto_uses_bf16_on_a_cpu_only_where_it_is_native(native: bool, expected: str | None) -> None:
    assert Amp.AUTO.dtype_name("cpu", native_cpu_bf16=native) == expected


def test_on_forces_bf16_on_any_cpu_and_off_forces_fp32() -> None:
    assert Amp.ON.dtype_name("cpu", native_cpu_bf16=False) == "bfloat16"
    assert Amp.OFF.dtype_name("cpu", native_cpu_bf16=True) is None
    assert Amp.OFF.dtype_name("cuda", native_cpu_bf16=True) is None


@pytest.mark.parametrize("amp", [Amp.AUTO, Amp.ON])
def test_cuda_autocasts_to_fp16_with_loss_scaling(amp: Amp) -> None:
    assert amp.dtype_name("cuda", native_cpu_bf16=False) == "float16"


def test_this_machines_auto_dtype_follows_what_onednn_reports() -> None:
    want = torch.bfloat16 if native_cpu_bf16() else None
    assert autocast_dtype(Amp.AUTO, torch.device("cpu")) is want


@pytest.mark.parametrize("raw, member", [(True, Amp.ON), (False, Amp.OFF), ("true", Amp.ON), ("off", Amp.OFF),
                                         ("auto", Amp.AUTO)])
def test_the_earlier_boolean_form_still_reads(raw: object, member: Amp) -> None:
    ls = Sources(file_data={"learner": {"amp": raw}}, environ={}).build(LearnerSettings, "learner")
    assert ls.amp is member


def test_an_unknown_amp_value_is_a_clear_config_error() -> None:
    with pytest.raises(ConfigError, match="amp"):
        LearnerSettings(amp="fp8")  # type: ignore[arg-type]


def test_the_default_is_auto() -> None:
    assert LearnerSettings().amp is Amp.AUTO
