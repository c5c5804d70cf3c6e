"""A fake `gcloud` for tests/test_launch_tpu.py: a queued resource's life, played from a state file.

Every call appends {"argv": [...], "kind": ..., "state": ...} as one JSON line to $FAKE_GCLOUD_LOG.
The queued resource (QR) lives in $FAKE_GCLOUD_STATE (JSON):

  create    gone -> WAITING_FOR_RESOURCES (fails with ALREADY_EXISTS when there is one)
  describe  prints the state; WAITING_FOR_RESOURCES turns into $FAKE_CREATE_OUTCOME (ACTIVE) on the
            describe after $FAKE_WAITING_DESCRIBES (2) waiting ones; with FAKE_PREEMPT=1, an ACTIVE
            QR of the first create turns PREEMPTED on the second describe after the first run was
            started; no QR: NOT_FOUND, exit status 1; the first $FAKE_DESCRIBE_ERRORS (0)
            describes fail with another error (UNAVAILABLE)
  delete    -> gone
  scp/ssh   exit status 255 unless ACTIVE; scp checks that the local tarball exists; an ssh whose
            command starts main (nohup) counts a run; the run-state query (resconv-status) answers
            for $FAKE_WORKERS (2) workers: none before any run, then running, then done once
            $FAKE_DONE_AFTER_RUNS (2) runs were started; with FAKE_MAIN_RESULT="exit 1" every
            worker reports main's exit status 1 after the first run; with FAKE_LOST_WORKER=1,
            after the first run, the last worker is lost (rebooted) and the others exited 5
            ("stopped responding": main's status for a lost peer)
"""

from __future__ import annotations

import json
import os
import sys


def _load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {
        "state": None,
        "waiting": 0,
        "creates": 0,
        "runs": 0,
        "after_run": 0,
        "preempted": False,
    }


def _kind(argv: list[str]) -> str:
    words = [a for a in argv if not a.startswith("--")]
    if words[:3] == ["compute", "tpus", "queued-resources"] and len(words) > 3:
        return words[3]
    if words[:3] == ["compute", "tpus", "tpu-vm"] and len(words) > 3:
        if words[3] == "scp":
            return "scp"
        command = _option(argv, "--command") or ""
        for marker, kind in (
            ("resconv-status", "status"),
            ("nohup", "run"),
            ("tar -xzf", "sync"),
            ("pip install", "setup"),
            ("tail -n", "logs"),
        ):
            if marker in command:
                return kind
        return "ssh"
    return "unknown"


def _option(argv: list[str], name: str) -> str | None:
    for arg in argv:
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def main() -> int:
    argv = sys.argv[1:]
    state_path = os.environ["FAKE_GCLOUD_STATE"]
    qr = _load(state_path)
    kind = _kind(argv)
    status, out, err = 0, "", ""
    env = os.environ

    if kind == "create":
        if qr["state"] is not None:
            status, err = 1, "ERROR: (gcloud) ALREADY_EXISTS: the queued resource exists"
        else:
            qr.update(state="WAITING_FOR_RESOURCES", waiting=0, after_run=0)
            qr["creates"] += 1
    elif kind == "describe":
        if qr.get("describe_errors", 0) < int(env.get("FAKE_DESCRIBE_ERRORS", "0")):
            qr["describe_errors"] = qr.get("describe_errors", 0) + 1
            status, err = 1, "ERROR: (gcloud) UNAVAILABLE: connection reset by peer"
        elif qr["state"] is None:
            status, err = 1, "ERROR: (gcloud) NOT_FOUND: Resource not found"
        else:
            if qr["state"] == "WAITING_FOR_RESOURCES":
                if qr["waiting"] >= int(env.get("FAKE_WAITING_DESCRIBES", "2")):
                    qr["state"] = env.get("FAKE_CREATE_OUTCOME", "ACTIVE")
                else:
                    qr["waiting"] += 1
            elif qr["state"] == "ACTIVE" and qr["runs"] >= 1 and not qr["preempted"]:
                if env.get("FAKE_PREEMPT") == "1" and qr["creates"] == 1:
                    qr["after_run"] += 1
                    if qr["after_run"] >= 2:
                        qr["state"], qr["preempted"] = "PREEMPTED", True
            out = qr["state"]
    elif kind == "delete":
        if qr["state"] is None:
            status, err = 1, "ERROR: (gcloud) NOT_FOUND: Resource not found"
        qr["state"] = None
    elif kind in ("scp", "status", "run", "sync", "setup", "logs", "ssh"):
        if qr["state"] != "ACTIVE":
            status, err = 255, f"ERROR: (gcloud) no TPU VM to reach (queued resource {qr['state']})"
        elif kind == "scp" and not os.path.isfile(argv[argv.index("scp") + 1]):
            status, err = 1, "ERROR: (gcloud) no such local file"
        elif kind == "run":
            qr["runs"] += 1
        elif kind == "status":
            if qr["runs"] == 0:
                word = "none"
            elif env.get("FAKE_MAIN_RESULT") == "exit 1":
                word = "exit 1 error: a run diverged at step 7"
            elif qr["runs"] >= int(env.get("FAKE_DONE_AFTER_RUNS", "2")):
                word = "done"
            else:
                word = "running"
            workers = int(env.get("FAKE_WORKERS", "2"))
            words = [word] * workers
            if env.get("FAKE_LOST_WORKER") == "1" and qr["runs"] == 1:
                stopped = (
                    "exit 5 error: process 1 of 2 stopped responding (5 s without a heartbeat): "
                    "stopping process 0; rerun the same command on every process to resume"
                )
                words = [stopped] * (workers - 1) + ["lost"]
            lines = ["Using ssh batch size of 1. Attempting to SSH into 1 nodes."]
            lines += [f"resconv-status t1v-n-{i} {w}" for i, w in enumerate(words)]
            out = "\n".join(lines)
        elif kind == "logs":
            out = "[t1v-n-0] step 10 loss 1.0"
    else:
        status, err = 2, f"fake gcloud: unexpected call {argv}"

    with open(state_path, "w") as f:
        json.dump(qr, f)
    with open(env["FAKE_GCLOUD_LOG"], "a") as f:
        f.write(json.dumps({"argv": argv, "kind": kind, "state": qr["state"], "rc": status}) + "\n")
    if out:
        print(out)
    if err:
        print(err, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
