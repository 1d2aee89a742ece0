"""The lost-rank diagnosis ([Note: lost rank] in infinity/comm/watchdog.py) on an in-process
TCPStore, with a fast heartbeat: who failed with which error, who stopped beating, who exited,
and a store whose host is gone; and the collectives' error carrying it."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from infinity.comm.collectives import Collectives, LostRankError
from infinity.comm.watchdog import CallNotMadeError, RankWatch

BEAT = 0.2


@pytest.fixture
def watches():
    """Three ranks' watches on one in-process store (closed before it goes)."""
    server = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    made = [RankWatch(server, r, 3, beat_s=BEAT, store_host="rank 0 (which hosts it)")
            for r in range(3)]
    yield made
    for w in made:
        w.close()


def test_a_reported_failure_is_named_with_its_error(watches):
    w = watches
    try:
        raise ValueError("bad batch")
    except ValueError as exc:
        w[2].report(exc, "forward")
    w[2].report(RuntimeError("later"), "step")            # the first report stands
    text = w[0].diagnose("all-gather")
    assert text.startswith("rank 2 (") and "pid" in text
    assert "failed: ValueError: bad batch (in forward)" in text and "later" not in text


def test_a_lost_rank_error_is_not_reported_as_a_failure(watches):
    w = watches
    w[1].report(LostRankError("rank 1: the all-gather failed: rank 2 stopped"), "forward")
    w[2].close()
    text = w[0].diagnose("all-gather")
    assert "rank 2 (" in text and "stopped: its heartbeat stopped" in text
    assert "rank 1" not in text


def test_a_withdrawn_report_is_forgotten(watches):
    w = watches
    w[1].report(RuntimeError("out of memory"), "forward")
    w[1].carried_on()
    text = w[0].diagnose("reduce-scatter")
    assert "out of memory" not in text and "every other rank is alive" in text


def test_a_silent_rank_is_named_and_an_exited_one_said_so(watches):
    w = watches
    w[1].close()              # killed: its heartbeat stops without a word
    w[2].mark_exited()        # its script ended
    text = w[0].diagnose("barrier")
    assert "rank 1 (" in text and "stopped: its heartbeat stopped" in text
    assert "rank 2 (" in text and "exited (its script ended) while this rank waited in the " \
        "barrier" in text


def test_a_store_that_is_gone_names_its_host():
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False,
                           timeout=datetime.timedelta(seconds=5))
    watch = RankWatch(client, 1, 2, beat_s=BEAT, store_host="rank 0 (which hosts it)")
    del server
    text = watch.diagnose()
    assert "no longer answers" in text and "rank 0 (which hosts it) has stopped" in text
    watch.close()


def test_a_failed_collective_raises_the_diagnosis():
    class Watch:
        def diagnose(self, what):
            return f"rank 3 stopped (seen from the {what})"

        def count_issue(self, what=""):   # what RankWatch counts for the calls every rank makes
            pass

    comm = Collectives(world_size=1, rank=0, watch=Watch())

    def broken(*_, group):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(LostRankError, match=r"rank 0: the all-gather failed: rank 3 stopped "
                       r"\(seen from the all-gather\)\. The collective's error: RuntimeError: "
                       r"Connection closed by peer"):
        comm._run("all-gather", broken, on=None)


def test_a_diagnosis_that_fails_does_not_hide_the_collective_error():
    def on_failure(what, exc):
        raise OSError("store gone")

    comm = Collectives(world_size=1, on_failure=on_failure)
    with pytest.raises(LostRankError, match=r"naming the lost rank failed: OSError: store gone"
                       r".*Connection reset"):
        comm._run("barrier", lambda group: (_ for _ in ()).throw(RuntimeError("Connection reset")),
                  on=None)


def test_a_call_waiting_on_live_ranks_says_why_before_its_timeout(infinity_log):
    """Ranks 1 and 2 beat but neither make the call nor issue a collective (waiting in a
    ``dist.barrier()``): rank 0 says so once after ``hint_after_s``, then gives up at its
    timeout naming them. A 1 s heartbeat: a beat silent for 5 s (a starved thread on a loaded
    machine) is past the 2 s timeout, so the answer is the timeout's whatever the load."""
    server = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    watches = [RankWatch(server, r, 3, beat_s=1.0, store_host="rank 0 (which hosts it)")
               for r in range(3)]
    try:
        with pytest.raises(CallNotMadeError, match=r"waited 2s for rank\(s\) \[1, 2\]"):
            watches[0].agree("save_checkpoint()", timeout_s=2.0, hint_after_s=0.3)
    finally:
        for w in watches:
            w.close()
    hints = [r.getMessage() for r in infinity_log.records if "alive but not calling" in r.getMessage()]
    assert len(hints) == 1 and "in save_checkpoint() for rank(s) [1, 2]" in hints[0]
    assert "dist.barrier()" in hints[0] and "must be called on every rank" in hints[0]


def test_a_timeout_between_live_ranks_names_their_counts_of_collectives():
    """Every rank alive, none failed, but their counts of issued collectives differ (one ran
    out of data): the diagnosis names the counts and who issued fewest (it named nobody). A
    1 s heartbeat, watched 3 s: a beat starved for 2 s still reads as alive."""
    server = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    w = [RankWatch(server, r, 3, beat_s=1.0, store_host="rank 0 (which hosts it)")
         for r in range(3)]
    try:
        w[0].issued, w[1].issued, w[2].issued = 63, 57, 63
        for watch in w[1:]:
            watch._beat_store.set(f"infinity/issued/{watch.rank}", str(watch.issued))
        text = w[0].diagnose("all-gather")
        assert "every other rank is alive" in text, text
        assert "rank 0 63, rank 1 57, rank 2 63" in text and "rank(s) [1] issued fewest" in text, text
        w[1].issued = 63
        w[1]._beat_store.set("infinity/issued/1", "63")
        assert "issued so far" not in w[0].diagnose("all-gather")
    finally:
        for watch in w:
            watch.close()


def test_a_timeout_at_equal_counts_names_each_ranks_collective():
    """The same count of collectives but not the same ones (an evaluation forward more on one
    rank at stage 3: its gathers paired with the other's backward): each rank's last one is
    named (it said only "a rank hangs, or the ranks issue different collectives")."""
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    w = [RankWatch(server, r, 2, beat_s=1.0) for r in range(2)]
    try:
        for watch, what in zip(w, ("all-gather of unit layers.1", "reduce-scatter of unit layers.3")):
            for _ in range(21):
                watch.count_issue(what)
            watch._beat_store.set(f"infinity/issued/{watch.rank}", f"21 {what}")
        text = w[0].diagnose("all-gather")
        assert "rank 0's is the all-gather of unit layers.1; rank 1's is the reduce-scatter of " \
               "unit layers.3" in text and "a forward more on one rank" in text, text
        w[1].count_issue("all-gather of unit layers.1")
        w[1]._beat_store.set("infinity/issued/1", "21 all-gather of unit layers.1")
        w[1].issued = 21
        assert "differs" not in w[0].diagnose("all-gather")
    finally:
        for watch in w:
            watch.close()
