"""The trainer's stop request: signals become a flag while it is entered, and leave as they were."""
from __future__ import annotations

import os
import signal

import pytest

from hetero_spec.train.stop import StopRequest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_request_instead_of_killing(sig):
    before = signal.getsignal(sig)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signal_name == signal.Signals(sig).name
    assert signal.getsignal(sig) is before


def test_a_second_ctrl_c_interrupts_at_once():
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_disabled_it_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest(enabled=False) as stop:
        assert signal.getsignal(signal.SIGTERM) is before and not stop.requested
