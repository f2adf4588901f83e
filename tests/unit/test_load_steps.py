"""The timed steps of a precompiled load, and work started in the background for a later step."""

import logging
import threading

from cgcompile.restart import load_steps


def test_background_work_runs_beside_the_load_and_its_wait_is_a_step_of_torchs_loader():
    started, release, ran = threading.Event(), threading.Event(), []

    def work():
        started.set()
        release.wait(5)
        ran.append(threading.current_thread().name)

    with load_steps.collecting() as steps:
        load_steps.in_background("keys", work)
        assert started.wait(5)  # running while the load goes on
        with load_steps.step("torch's loader"):
            assert ran == []
            release.set()
            load_steps.await_background()
            assert ran == ["cgcompile-load-keys"]
    assert list(steps) == ["keys (waited)", "torch's loader"]
    inside = load_steps.inside_torch(steps)
    assert inside["torch's loader"] == max(steps["torch's loader"] - steps["keys (waited)"], 0.0)


def test_outside_a_load_background_work_does_not_run():
    ran = []
    load_steps.in_background("keys", lambda: ran.append(1))
    load_steps.await_background()
    assert ran == []


def test_a_failure_in_the_background_is_logged_and_the_load_goes_on(caplog):
    def work():
        raise RuntimeError("no Triton here")

    with caplog.at_level(logging.DEBUG, logger="cgcompile.restart.load_steps"):
        with load_steps.collecting() as steps:
            load_steps.in_background("keys", work)
            load_steps.await_background()
    assert "background step 'keys' of a load failed" in caplog.text
    assert "no Triton here" in caplog.text
    assert "keys (waited)" in steps


def test_work_no_step_waited_for_ends_with_its_load():
    release, done = threading.Event(), threading.Event()

    def work():
        release.wait(5)
        done.set()

    with load_steps.collecting():
        load_steps.in_background("keys", work)
        release.set()
    assert done.is_set()
