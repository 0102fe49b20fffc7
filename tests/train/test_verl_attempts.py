"""A verl run over a kill and a resume (grpo.train.verl_attempts): nothing lost, nothing counted twice."""

import json

from grpo.layout import TrainDir
from grpo.train import verl_watch
from grpo.train.metrics_log import metrics_from_verl
from grpo.train.verl_attempts import latest_components, merged_verl_rows, start_attempt


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_killed_attempt_and_its_resume_give_each_step_once(tmp_path):
    out, ckpt = tmp_path, TrainDir(tmp_path).verl_checkpoints
    ckpt.mkdir()
    failures, components = TrainDir(out).reward_failures, TrainDir(out).reward_components
    first = start_attempt(out, ckpt, True, [components], failures)
    assert (first.number, first.resume_step) == (0, 0)
    # attempt 0 logs steps 1 and 2 but is killed after the checkpoint of step 1, before step 2's
    write_jsonl(first.verl_log, [{"step": 1, "data": {"critic/score/mean": 0.5}},
                                 {"step": 2, "data": {"critic/score/mean": 0.1, "actor/only_in_the_killed_step": 1.0}}])
    write_jsonl(components, [{"step": 0, "attempt": 0, "score": 0.5}, {"step": 1, "attempt": 0, "score": 0.1},
                             {"step": 0, "attempt": 0, "score": 0.5, "validate": True}])
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    failures.write_text('{"attempt": 0, "id": "a"}\n')
    second = start_attempt(out, ckpt, True, [components], failures)
    assert (second.number, second.resume_step) == (1, 1) and second.verl_log != first.verl_log
    assert components.exists() and second.failures_from == failures.stat().st_size   # kept, watched from here
    # attempt 1 validates at its resume step, then trains steps 2 and 3
    write_jsonl(second.verl_log, [{"step": 1, "data": {"val-core/x": 0.7}},
                                  {"step": 2, "data": {"critic/score/mean": 0.3}},
                                  {"step": 3, "data": {"critic/score/mean": 0.4}}])
    with components.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in [{"step": 1, "attempt": 1, "score": 0.3},
                                                       {"step": 2, "attempt": 1, "score": 0.4}]))
    rows = metrics_from_verl(merged_verl_rows(out), components)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["reward_mean"] for r in rows] == [0.5, 0.3, 0.4]        # step 2: the resumed attempt's, not 0.1
    assert rows[0]["val-core/x"] == 0.7                                # the resume's validation joins step 1
    assert "actor/only_in_the_killed_step" not in rows[1]              # nothing of the killed step 2 is left
    kept = latest_components([json.loads(x) for x in components.read_text().splitlines()])
    assert sorted((r["step"], r["attempt"], r["score"]) for r in kept if not r.get("validate")) == [
        (0, 0, 0.5), (1, 1, 0.3), (2, 1, 0.4)]                         # attempt 0's partial step 2 dropped
    assert len([r for r in kept if r.get("validate")]) == 1
    # the failure of attempt 0 is history: it does not stop attempt 1; a new one does
    assert verl_watch.new_failure(failures, second.failures_from) is None
    with failures.open("a") as f:
        f.write('{"attempt": 1, "id": "b"}\n')
    assert json.loads(verl_watch.new_failure(failures, second.failures_from))["id"] == "b"


def test_a_fresh_start_clears_the_previous_runs_logs(tmp_path):
    out, ckpt = tmp_path, TrainDir(tmp_path).verl_checkpoints
    components, failures = TrainDir(out).reward_components, TrainDir(out).reward_failures
    start_attempt(out, ckpt, True, [components], failures)
    components.write_text('{"step": 0, "attempt": 0, "score": 0.5}\n')
    again = start_attempt(out, ckpt, True, [components], failures)     # no checkpoint: nothing to resume
    assert again.number == 0 and not components.exists()
    (ckpt / "x").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    assert start_attempt(out, ckpt, False, [components], failures).resume_step == 0   # train.resume=false
