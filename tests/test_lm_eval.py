"""A real evaluator against the server: lm-evaluation-harness's ``local-completions`` model scores a small
multiple-choice task through ``/v1/completions`` (``echo`` with the prompt's log-probabilities, token-id
prompts, several prompts per request), and its ``hf`` model scores the same task on the same checkpoint with
HF transformers in float32. Each choice's log-likelihood agrees within float32 noise, and so do the greedy
flags (all false here: no six-word continuation is the lightly trained model's greedy one) and the accuracy,
which is well above chance.

The task (``tests/data/lm_eval``) is 36 four-way items built from the bundled corpus, which a tiny-llama
trained on it for 40 CPU seconds tells apart from the continuations of other lines. No hub access: the
data is a local JSONL, the checkpoint and its tokenizer a local directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml
from ray import serve

from tests.serve_harness import OVERRIDES, start_local_serve
from tests.trained import train_checkpoint
from worker.checkpoint.writer import CORPUS_PATH

lm_eval = pytest.importorskip("lm_eval")  # CI installs it (dev extra)
pytest.importorskip("transformers")

DATA = Path(__file__).parent / "data" / "lm_eval"
TASK = "graphfleet_corpus_mc"
MODEL_NAME = "tiny"
#: Enough training for about 0.8 accuracy on the task (0.25 is chance) in about 40 s on 2 CPU cores;
#: ``make run``'s 300 steps of 32 windows would take four minutes.
TRAIN = {"steps": 120, "batch": 16, "lr": 8e-3}
#: A choice's log-likelihood sums 6-42 token log-probabilities (tens to hundreds of nats): the two float32
#: implementations differ by at most 2.1e-5 on it here; a token scored at a wrong position is off by nats.
ABS_TOL, REL_TOL = 1e-3, 1e-5


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No hub access in this module (none is needed; this guards against a fallback to it). datasets and
    huggingface_hub read the environment once, when first imported, so their flags are set as well."""
    import datasets.config
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
            mp.setenv(name, "1")
            mp.setattr(datasets.config, name, True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def trained(checkpoint_dir, tmp_path_factory):
    src = checkpoint_dir("tiny-llama")
    return train_checkpoint(src, tmp_path_factory.mktemp("lm-eval") / "tiny-llama-trained", device="cpu",
                            **TRAIN)


@pytest.fixture(scope="module")
def server(trained):
    yield start_local_serve({"model": str(trained), "overrides": OVERRIDES, "model_name": MODEL_NAME,
                             "fleet": {"name": "lmeval"}}, "graphfleet-lmeval")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """The task's config, its data file absolute (datasets resolves a relative one against the working
    directory) and datasets' cache in a temporary directory."""
    cfg = yaml.safe_load((DATA / "corpus_mc.yaml").read_text())
    assert cfg["task"] == TASK
    cfg["dataset_kwargs"] = {"data_files": {"test": str(DATA / "corpus_mc.jsonl")},
                             "cache_dir": str(tmp_path_factory.mktemp("datasets"))}
    return cfg


def _evaluate(model: str, model_args: dict, task: dict) -> tuple[float, dict[int, dict]]:
    """(accuracy, {doc_id: logged sample}) of ``model`` on the task."""
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task],
                                  task_manager=TaskManager(include_defaults=False), log_samples=True,
                                  bootstrap_iters=0)
    samples = out["samples"][TASK]
    return out["results"][TASK]["acc,none"], {s["doc_id"]: s for s in samples}


def test_items_are_corpus_lines_with_one_true_continuation():
    corpus = " ".join(CORPUS_PATH.read_text().split())
    items = [json.loads(line) for line in (DATA / "corpus_mc.jsonl").read_text().splitlines()]
    assert 30 <= len(items) <= 40
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == 4
        assert f"{item['context']} {item['choices'][item['label']]}" in corpus, item
        assert not any(f"{item['context']} {c}" in corpus for i, c in enumerate(item["choices"])
                       if i != item["label"]), item
    assert len({item["label"] for item in items}) == 4  # the right answer is not always in one place


def test_local_completions_scores_equal_hf_transformers(trained, server, task):
    # The tokenizer adds BOS by default; lm-eval's hf model keeps that default (0.4.13; 0.4.8 leaves it out) and
    # local-completions leaves it out unless asked: both are told to, so both score (BOS + context) -> choice.
    api_acc, api = _evaluate("local-completions", {
        "base_url": f"{server}/v1/completions", "model": MODEL_NAME, "tokenizer_backend": "huggingface",
        "tokenizer": str(trained), "tokenized_requests": True, "add_bos_token": True, "batch_size": 4,
        "num_concurrent": 1, "max_retries": 1, "timeout": 120}, task)
    hf_acc, hf = _evaluate("hf", {"pretrained": str(trained), "dtype": "float32", "device": "cpu",
                                  "batch_size": 1, "add_bos_token": True}, task)

    assert sorted(api) == sorted(hf) == list(range(len(hf)))
    worst = 0.0
    for doc_id, want in hf.items():
        got = api[doc_id]
        assert got["arguments"] == want["arguments"], doc_id
        got_ll, got_greedy = zip(*got["filtered_resps"])
        want_ll, want_greedy = zip(*want["filtered_resps"])
        assert got_ll == pytest.approx(want_ll, rel=REL_TOL, abs=ABS_TOL), doc_id
        assert got_greedy == want_greedy, doc_id
        assert got["acc"] == want["acc"], doc_id
        worst = max(worst, *(abs(a - b) for a, b in zip(got_ll, want_ll)))
    print(f"accuracy {api_acc:.3f} (hf {hf_acc:.3f}); largest log-likelihood difference {worst:.2e}")
    assert api_acc == hf_acc
    assert hf_acc >= 0.5, "the trained checkpoint should tell the corpus's continuations apart (chance: 0.25)"
