"""What the engine refuses before any work starts: bad configuration and bad request parameters.
No model is loaded here."""

from __future__ import annotations

import pytest
import torch

from radixserve.cluster.config import parse_cli
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.protocol import (
    MAX_LOGIT_BIAS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    InvalidRequest,
    SamplingParams,
    check_context_length,
)


# Configuration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda"])
def test_supported_devices_are_accepted(device):
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("device", ["cuda:0", "mps", "CPU", ""])
def test_other_devices_are_a_startup_error(device):
    with pytest.raises(ValueError) as e:
        EngineConfig(device=device)
    assert str(e.value) == f"device {device!r} is not supported; supported devices: auto, cpu, cuda"


def test_cli_refuses_an_unsupported_device(capsys):
    assert parse_cli(["--device", "cuda"]).engine.device == "cuda"
    with pytest.raises(SystemExit) as e:
        parse_cli(["--device", "mps"])
    assert e.value.code == 2  # argparse's usage error
    assert "invalid choice: 'mps'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_a_gpu_is_a_clear_startup_error():
    """Before anything loads: the engine names what is missing and what to run instead."""
    from radixserve.workers.distributed.device import resolve_device
    from radixserve.workers.engine.engine import Engine

    with pytest.raises(RuntimeError, match=r"--device cuda was asked for, but .*; run with --device cpu"):
        resolve_device("cuda")
    with pytest.raises(RuntimeError, match="--device cuda was asked for"):
        Engine(device="cuda")
    assert resolve_device("auto").type == "cpu"


def test_attention_backend_is_checked_at_startup(capsys):
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flashinfer")
    with pytest.raises(SystemExit):
        parse_cli(["--attention-backend", "flashinfer"])
    assert parse_cli(["--attention-backend", "triton"]).engine.attention_backend == "triton"


@pytest.mark.parametrize(
    "configured,model,expected", [(None, 8192, 8192), (2048, 8192, 2048), (100_000, 8192, 8192)]
)
def test_context_cap_never_exceeds_the_model(configured, model, expected):
    assert EngineConfig(context_length=configured).context_cap(model) == expected


# Request limits --------------------------------------------------------------------------------
def test_context_length_check_and_its_message():
    check_context_length(1000, 1048, 2048)  # exactly full: fine
    with pytest.raises(InvalidRequest) as e:
        check_context_length(1000, 1049, 2048, "max_completion_tokens")
    assert (e.value.param, e.value.code) == ("max_completion_tokens", "context_length_exceeded")
    assert e.value.message == (
        "This model's maximum context length is 2048 tokens. However, you requested 2049 tokens "
        "(1000 in the prompt, 1049 for the completion). Please reduce the prompt or the completion "
        "length."
    )


# Sampling parameters -----------------------------------------------------------------------------
def refused(**params) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(params)
    return e.value


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-45, 1e-44, 1e-7, 9.99e-7])
def test_tiny_temperatures_mean_greedy(temperature):
    assert SamplingParams.from_dict({"temperature": temperature}).greedy


@pytest.mark.parametrize("temperature", [1e-6, 0.01, 1.0, 7.5])
def test_other_temperatures_sample(temperature):
    assert not SamplingParams.from_dict({"temperature": temperature}).greedy
    assert SamplingParams.from_dict({"temperature": temperature, "top_k": 1}).greedy


@pytest.mark.parametrize(
    "params,param,message",
    [
        ({"repetition_penalty": 1e-45}, "repetition_penalty", "'repetition_penalty' must be in [0.01, 2.0]"),
        ({"repetition_penalty": 0.0099}, "repetition_penalty", "'repetition_penalty' must be in [0.01, 2.0]"),
        ({"repetition_penalty": 2.01}, "repetition_penalty", "'repetition_penalty' must be in [0.01, 2.0]"),
        (
            {"repetition_penalty": float("nan")},
            "repetition_penalty",
            "'repetition_penalty' must be a finite number",
        ),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "'frequency_penalty' must be in [-2, 2]"),
        ({"presence_penalty": 3}, "presence_penalty", "'presence_penalty' must be in [-2, 2]"),
        ({"min_p": 1.5}, "min_p", "'min_p' must be in [0, 1]"),
        ({"top_p": 0}, "top_p", "'top_p' must be in (0, 1]"),
        ({"temperature": float("inf")}, "temperature", "'temperature' must be a finite number"),
        ({"temperature": -1e-45}, "temperature", "'temperature' must be >= 0"),
        (
            {"min_new_tokens": 11, "max_new_tokens": 10},
            "min_new_tokens",
            "'min_new_tokens' (11) must not exceed 'max_new_tokens' (10)",
        ),
        ({"seed": 2**64}, "seed", f"'seed' must be in [{-(2**63)}, {2**64 - 1}]"),
        ({"seed": -(2**63) - 1}, "seed", f"'seed' must be in [{-(2**63)}, {2**64 - 1}]"),
        ({"seed": 2**64 - 3, "n": 4}, "seed", f"'seed' must be in [{-(2**63)}, {2**64 - 4}]"),
        ({"seed": 1.5}, "seed", "'seed' must be an integer"),
        # JSON integers past float's range (native /generate keeps them as Python ints).
        ({"temperature": 10**400}, "temperature", "'temperature' must be a finite number"),
        ({"min_p": -(10**400)}, "min_p", "'min_p' must be a finite number"),
        ({"logit_bias": {"1": 10**400}}, "logit_bias", "'logit_bias' must map token ids to numbers"),
        # Keys are canonical decimal token ids: no spelling int() would also take, so that two
        # keys never name one token ("12" and "012" merged silently before).
        (
            {"logit_bias": {" 12 ": 1}},
            "logit_bias",
            "'logit_bias' keys must be token ids in decimal, got ' 12 '",
        ),
        (
            {"logit_bias": {"1_0": 1}},
            "logit_bias",
            "'logit_bias' keys must be token ids in decimal, got '1_0'",
        ),
        (
            {"logit_bias": {"\u0665": 1}},
            "logit_bias",
            "'logit_bias' keys must be token ids in decimal, got '\u0665'",
        ),
        (
            {"logit_bias": {"12": 1, "012": 2}},
            "logit_bias",
            "'logit_bias' keys must be token ids in decimal, got '012'",
        ),
        ({"logit_bias": {"+3": 1}}, "logit_bias", "'logit_bias' keys must be token ids in decimal, got '+3'"),
        (
            {"logit_bias": {True: 1}},
            "logit_bias",
            "'logit_bias' keys must be token ids in decimal, got 'True'",
        ),
        ({"logit_bias": {"1": True}}, "logit_bias", "'logit_bias' must map token ids to numbers"),
        ({"logit_bias": [[1, 2]]}, "logit_bias", "'logit_bias' must map token ids to numbers"),
        (
            {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            f"'logit_bias' may have at most {MAX_LOGIT_BIAS} entries",
        ),
        (
            {"stop": ["x" * (MAX_STOP_CHARS + 1)]},
            "stop",
            f"a stop string may be at most {MAX_STOP_CHARS} characters long",
        ),
        (
            {"stop": ["s"] * (MAX_STOP_STRINGS + 1)},
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings are allowed",
        ),
    ],
)
def test_out_of_range_parameters_are_refused(params, param, message):
    e = refused(**params)
    assert (e.param, e.message) == (param, message)


@pytest.mark.parametrize("seed", [0, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)])
def test_every_accepted_seed_seeds_a_generator(seed):
    p = SamplingParams.from_dict({"seed": seed})
    torch.Generator().manual_seed(p.seed)  # what the engine does with it: no error


def test_logit_bias_keys_that_are_token_ids():
    p = SamplingParams.from_dict({"logit_bias": {"0": 1, "12": -100, 7: 2.5, "49151": 100}})
    assert p.logit_bias == {0: 1.0, 12: -100.0, 7: 2.5, 49151: 100.0}
    p = SamplingParams.from_dict(
        {"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS)}, "stop": ["x" * MAX_STOP_CHARS]}
    )
    assert len(p.logit_bias) == MAX_LOGIT_BIAS


def test_limits_that_are_still_accepted():
    p = SamplingParams.from_dict(
        {"repetition_penalty": 0.01, "min_new_tokens": 10, "max_new_tokens": 10, "min_p": 1, "top_p": 1}
    )
    assert (p.repetition_penalty, p.min_new_tokens) == (0.01, 10)
    assert SamplingParams.from_dict({"repetition_penalty": 2}).repetition_penalty == 2
