"""scripts/gpu/detached.sh: a run started in one call on the GPU host outlives that call's processes, and `wait`
reports it running, then ended with its exit status, within the seconds it is given."""
import os
import signal
import subprocess
from pathlib import Path

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "detached.sh")


def detached(tmp_path, *args, **kwargs):
    return subprocess.run(["bash", SCRIPT, *args], env={**os.environ, "DETACHED_ROOT": str(tmp_path)},
                          capture_output=True, text=True, timeout=60, **kwargs)


def test_a_run_survives_the_end_of_the_call_that_started_it_and_wait_reports_its_status(tmp_path):
    gate, marker = tmp_path / "gate", tmp_path / "marker"
    # the run goes on only once the test opens the gate, so "still running" below does not depend on timing;
    # the call has its own process group, ended as the host ends what a call leaves running
    call = subprocess.Popen(["bash", SCRIPT, "start", "job", "bash", "-c",
                             f"until [ -e {gate} ]; do sleep 0.1; done; echo line from the run; touch {marker}; exit 7"],
                            env={**os.environ, "DETACHED_ROOT": str(tmp_path)}, start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert call.communicate(timeout=30)[0].strip() == f"started job: log {tmp_path}/job/log"
    try:  # the host ends whatever the call left in its group
        os.killpg(call.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing was left there: the run has a session of its own
        pass
    still = detached(tmp_path, "wait", "job", "0")
    assert still.returncode == 3 and still.stdout.strip().endswith("job still running")
    gate.touch()
    ended = detached(tmp_path, "wait", "job", "30")  # without the run (killed with the call) this returns 3
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.splitlines()[-2:] == ["line from the run", "job ended with status 7"]
    assert marker.exists() and (tmp_path / "job" / "rc").read_text().strip() == "7"


def test_a_name_runs_once_and_bad_usage_is_refused(tmp_path):
    assert detached(tmp_path, "start", "job", "true").returncode == 0
    again = detached(tmp_path, "start", "job", "true")
    assert again.returncode == 2 and "a run named job was started already" in again.stderr
    assert detached(tmp_path, "wait", "job", "ten").returncode == 2
    unknown = detached(tmp_path, "wait", "other", "1")
    assert unknown.returncode == 2 and "no run named other" in unknown.stderr

