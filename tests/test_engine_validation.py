"""What the engine refuses before any work starts: bad configuration and bad request parameters.
No model is loaded here."""

from __future__ import annotations

import pytest

from radixserve.cluster.config import parse_cli
from radixserve.workers.engine.config import EngineConfig
from radixserve.workers.protocol import InvalidRequest, check_context_length


# Configuration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_supported_devices_are_accepted(device):
    assert EngineConfig(device=device).device == device


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "mps", "CPU", ""])
def test_other_devices_are_a_startup_error(device):
    with pytest.raises(ValueError) as e:
        EngineConfig(device=device)
    assert str(e.value) == f"device {device!r} is not supported; supported devices: auto, cpu"


def test_cli_refuses_an_unsupported_device(capsys):
    assert parse_cli(["--device", "cpu"]).engine.device == "cpu"
    with pytest.raises(SystemExit) as e:
        parse_cli(["--device", "cuda"])
    assert e.value.code == 2  # argparse's usage error
    assert "device 'cuda' is not supported; supported devices: auto, cpu" in capsys.readouterr().err


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
