"""The multi-process watchdog (`multihost.PeerWatchdog`) on a fake coordination service: when
it calls a process lost, and that its ticks keep to their schedule on a slow machine."""

import threading
import time

import jax
import pytest
from jax._src import distributed

from resconv_jax.runtime import multihost


class FakeService:
    """The coordination service's key-value store; each call takes `cost` seconds (a loaded
    machine, a slow loopback)."""

    def __init__(self, cost: float = 0.0):
        self.values, self.cost, self.lock = {}, cost, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        time.sleep(self.cost)
        with self.lock:
            self.values[key] = value

    def key_value_try_get(self, key):
        time.sleep(self.cost)
        with self.lock:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")  # as jaxlib says of a key not set yet
            return self.values[key]


@pytest.fixture
def service(monkeypatch):
    """Process 0 of 2 on a fake service; process 1 never beats unless a test does it."""
    fake = FakeService()
    monkeypatch.setattr(distributed.global_state, "client", fake)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    return fake


def test_a_silent_process_is_lost_after_lost_after_seconds(service):
    """Process 1 never beats. A peer not seen beating at the watchdog's first look (one that
    started its watchdog a tick later, on a loaded machine) was taken for a lost coordinator
    (a KeyError in the watchdog): this process stopped at once, naming the wrong cause."""
    lost = []
    watchdog = multihost.PeerWatchdog(lambda message, *_: lost.append(message), 0.5, 0.05)
    started = time.monotonic()
    watchdog.start()
    while not lost and time.monotonic() - started < 30:
        time.sleep(0.01)
    assert time.monotonic() - started >= 0.5
    assert len(lost) == 1 and "process 1 of 2 stopped responding" in lost[0], lost


def test_a_process_that_failed_stops_this_one_and_gets_its_last_words(service):
    lost = []
    watchdog = multihost.PeerWatchdog(lambda *args: lost.append(args), 10.0, 0.05)
    service.key_value_set(f"{multihost.PeerWatchdog.PREFIX}/done/1", "2")
    watchdog.start().wait_for_loss()
    ((message, last_words),) = lost
    assert "process 1 of 2 exited with status 2" in message
    last_words()
    assert service.values[f"{multihost.PeerWatchdog.PREFIX}/stops/0"] == "1"


def test_ticks_keep_their_schedule_when_each_tick_takes_time(service):
    """Each tick reads and writes the store (3 calls here). Its ticks drifted by that much
    each: a peer's silence was counted late, and a process that waited `lost_after` + 2 ticks
    for the watchdog to name a lost peer gave up first, with a traceback instead of the line."""
    service.cost = 0.02  # 60 ms of calls per 100 ms tick
    watchdog = multihost.PeerWatchdog(lambda *_: None, 100.0, 0.1).start()
    started = time.monotonic()
    time.sleep(1.5)
    watchdog.finish(0)
    elapsed = time.monotonic() - started
    beats = int(service.values[f"{multihost.PeerWatchdog.PREFIX}/beat/0"])
    assert beats >= 0.8 * elapsed / 0.1, (beats, elapsed)  # drifting: ~0.63 of them
