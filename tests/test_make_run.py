"""What ``make run`` does, as a newcomer meets it: ``graphfleet make-checkpoint --train-steps``
trains the tiny checkpoint on the bundled corpus, ``graphfleet serve`` prints a curl line, and that
curl's completion continues the corpus's line in words (a random-weight model answers random tokens).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time

import pytest

from tests.serve_harness import OVERRIDES, http
from tests.test_serve_cli import REPO, Serve, _env
from worker.checkpoint.train import TRAINING_FILE, TRY_PROMPT
from worker.checkpoint.writer import CORPUS_PATH


def _makefile_steps() -> int:
    text = (REPO / "Makefile").read_text()
    found = re.search(r"^RUN_TRAIN_STEPS \?= (\d+)$", text, re.M)
    assert found and "--train-steps $(RUN_TRAIN_STEPS)" in text, "the run target trains its checkpoint"
    return int(found.group(1))


#: As the Makefile's run target.
MAKE_RUN_STEPS = _makefile_steps()


def test_make_checkpoint_refuses_bad_training_arguments(tmp_path):
    cmd = [sys.executable, "-m", "deploy.cli", "make-checkpoint", "--preset", "tiny-llama"]
    bad = subprocess.run([*cmd, "--out", str(tmp_path / "a"), "--train-steps", "-1"], capture_output=True,
                         text=True, env=_env(), cwd=REPO, timeout=120)
    assert bad.returncode != 0 and "--train-steps must be >= 0, got -1" in bad.stderr
    assert not (tmp_path / "a").exists()


@pytest.mark.timeout(900)
def test_make_runs_checkpoint_answers_the_printed_curl_in_words(tmp_path):
    out = tmp_path / "tiny-llama-trained"
    made = subprocess.run([sys.executable, "-m", "deploy.cli", "make-checkpoint", "--preset", "tiny-llama",
                           "--train-steps", str(MAKE_RUN_STEPS), "--out", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=REPO, timeout=840)
    assert made.returncode == 0, made.stderr[-3000:]
    training = json.loads((out / TRAINING_FILE).read_text())
    assert training["steps"] == MAKE_RUN_STEPS and training["try_prompt"] == TRY_PROMPT
    assert not out.with_name(out.name + ".random").exists()  # the random start is cleaned up
    again = subprocess.run([sys.executable, "-m", "deploy.cli", "make-checkpoint", "--preset", "tiny-llama",
                            "--train-steps", "1", "--out", str(out)], capture_output=True, text=True, env=_env(),
                           cwd=REPO, timeout=120)
    assert again.returncode != 0 and "holds a checkpoint already" in again.stderr

    s = Serve(out, tmp_path / "serve.log", *OVERRIDES)
    try:
        s.wait_ready()
        deadline = time.monotonic() + 60  # the line comes once the serve has seen /health answer 200 too
        while not (printed := [ln for ln in s.output().splitlines() if ln.strip().startswith("curl ")]):
            assert time.monotonic() < deadline, s.output()[-3000:]
            time.sleep(0.2)
        printed = printed[0]
        args = shlex.split(printed)
        body = json.loads(args[args.index("-d") + 1])
        assert body["prompt"] == TRY_PROMPT
        status, answer, _ = http("POST", f"{s.base}/v1/completions", body)
        assert status == 200, answer
    finally:
        s.stop()
    text = answer["choices"][0]["text"]
    corpus = CORPUS_PATH.read_text()
    line = corpus[corpus.index(TRY_PROMPT) + len(TRY_PROMPT):]
    # Its continuation, word for word: the first five words at least (random weights give none).
    words, expected = text.split(), line.split()
    assert len(words) >= 5 and words[:5] == expected[:5], (text, line[:100])
