"""set_switch_interval sets the interpreter's GIL switch interval only when asked;
ProcessConfig.gil_switch_interval_ms takes milliseconds in (0, 1000] or None and names itself
and its values otherwise."""

import sys

import pytest

from rayinfer.config import ConfigError
from rayinfer.process_config import ProcessConfig
from rayinfer.workers.gil_switch import set_switch_interval


@pytest.fixture
def restored_interval():
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_none_leaves_the_interval(restored_interval):
    assert set_switch_interval(None) == restored_interval == sys.getswitchinterval()


def test_milliseconds_become_the_interval(restored_interval):
    assert set_switch_interval(0.5) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


def test_workers_take_half_a_millisecond_unless_told():
    assert ProcessConfig().gil_switch_interval_ms == 0.5
    assert ProcessConfig(gil_switch_interval_ms=None).gil_switch_interval_ms is None


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), 1001, "1", True])
def test_bad_intervals_name_the_key(value):
    with pytest.raises(ConfigError, match=r"process\.gil_switch_interval_ms=.*\(0, 1000\]"):
        ProcessConfig(gil_switch_interval_ms=value)
