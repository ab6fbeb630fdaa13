"""``training.contrastive``: the InfoNCE it computes, that it trains what it says, and its output directory.

Pairs are built here from real policy text in FlagEmbedding's format (what ``training.pairs``
writes, or a user brings): a 32-character slice of a 100-character chunk is the query, the chunk
its positive, three other chunks of the same document its hard negatives. Every fifth chunk is
held out as the dev split: its queries and positives never appear in training. (Whole held-out
documents, as ``training.pairs`` holds out, move a 2-layer, hidden-32 model too little in 40
steps to test on: measured dev MRR@10 0.25 → 0.28 there, against 0.14 → 0.33 on held-out chunks.)
The model that the learning test trains first gets 30 steps of unsupervised SimCSE (this stage
with query = passage, in-batch negatives only), so that it starts from something, as a real run
starts from a pre-trained encoder.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file

from chatchat_policybert.chatchat.registry import load_embeddings
from chatchat_policybert.chatchat.settings import LocalEmbeddingsConfig
from chatchat_policybert.errors import run_cli
from chatchat_policybert.model.embeddings import PolicyBertEmbeddings
from chatchat_policybert.model.loading import load_policybert, save_model_dir
from chatchat_policybert.model.tokenization_policybert import DEFAULT_QUERY_INSTRUCTION, FILES_KEY, PROMPTS_FILE
from tests.support.outside_chatchat import check_loads_outside_chatchat
from training.contrastive import ContrastiveConfig, ContrastiveTask, contrastive, info_nce, main, read_examples

CHUNK, QUERY, DEV_EVERY = 100, 32, 5


def chunks(text: str) -> list[str]:
    text = "".join(text.split())
    return [text[i : i + CHUNK] for i in range(0, min(len(text), 24 * CHUNK) - CHUNK + 1, CHUNK)]


def write_jsonl(lines: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def pairs(policy_documents, tmp_path_factory) -> dict[str, Path]:
    rng = random.Random(1)
    out = tmp_path_factory.mktemp("pairs")
    lines: dict[str, list[dict]] = {"train": [], "dev": []}
    for doc in policy_documents:
        passages = chunks(doc.content)
        for j, passage in enumerate(passages):
            start = rng.randrange(CHUNK - QUERY)
            others = passages[:j] + passages[j + 1 :]
            line = {"query": passage[start : start + QUERY], "pos": [passage], "neg": rng.sample(others, 3)}
            lines["dev" if j % DEV_EVERY == 0 else "train"].append(line)
    files = {name: write_jsonl(split, out / f"{name}.jsonl") for name, split in lines.items()}
    simcse = [{"query": line["pos"][0], "pos": line["pos"]} for line in lines["train"]]
    files["simcse"] = write_jsonl(simcse, out / "simcse.jsonl")
    return files


def run(model: Path, pairs: dict[str, Path], out: Path, *flags: str, train: str = "train") -> Path:
    """The stage's command line on CPU; returns ``OUT``."""
    argv = ["--model", str(model), "--train", str(pairs[train]), "--dev", str(pairs["dev"]), "--out", str(out)]
    assert run_cli(main, [*argv, "--device", "cpu", "--max-length", "128", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def start_model(tiny_model_dir, pairs, tmp_path_factory) -> Path:
    """The tiny attn model after 30 steps of unsupervised SimCSE (query = passage, dropout views)."""
    out = tmp_path_factory.mktemp("simcse")
    flags = ["--train-group-size", "1", "--query-instruction", "", "--max-steps", "30", "--lr", "3e-3"]
    run(
        tiny_model_dir("attn", perturb=True),
        pairs,
        out,
        *flags,
        "--batch-size",
        "16",
        "--temperature",
        "0.05",
        train="simcse",
    )
    return out / "final"


def hand_info_nce(
    queries: torch.Tensor, passages: torch.Tensor, positives: list[int], temperature: float
) -> torch.Tensor:
    """-log softmax of each query's positive, written out term by term."""
    losses = []
    for q, positive in zip(queries, positives):
        exps = [math.exp(float(q @ p) / temperature) for p in passages]
        losses.append(-math.log(exps[positive] / sum(exps)))
    return torch.tensor(sum(losses) / len(losses))


def test_info_nce_is_the_hand_computed_loss():
    torch.manual_seed(0)
    queries = F.normalize(torch.randn(3, 8), dim=-1)
    passages = F.normalize(torch.randn(6, 8), dim=-1)
    loss = info_nce(queries, passages, group_size=2, temperature=0.05)
    assert loss.item() == pytest.approx(hand_info_nce(queries, passages, [0, 2, 4], 0.05).item(), rel=1e-5)


def test_loss_is_taken_on_the_served_vectors(tiny_model_dir, pairs, tmp_path):
    """The training loss equals InfoNCE over what PolicyBertEmbeddings returns for the same texts.

    One positive and one negative per line make the drawn group exactly (pos, neg); the model is
    in eval mode (no dropout) so that the two paths must agree.
    """
    lines = [json.loads(line) for line in pairs["train"].read_text(encoding="utf-8").splitlines()[:4]]
    path = write_jsonl([{**line, "neg": line["neg"][:1]} for line in lines], tmp_path / "two.jsonl")
    model_dir = tiny_model_dir("gate", perturb=True)
    model, tokenizer = load_policybert(model_dir)
    cfg = ContrastiveConfig(out=tmp_path, train_group_size=2, temperature=0.05)
    task = ContrastiveTask(tokenizer, read_examples(path, 1), [], cfg, max_length=512)
    loss = task.loss(model, task.batch([0, 1, 2, 3], "0-0-0"))

    served = PolicyBertEmbeddings(model_dir)
    queries = torch.tensor([served.embed_query(line["query"]) for line in lines])
    passages = torch.tensor(
        served.embed_documents([text for line in lines for text in (line["pos"][0], line["neg"][0])])
    )
    assert loss.item() == pytest.approx(info_nce(queries, passages, 2, 0.05).item(), rel=1e-4)


def test_embed_chunk_gives_the_whole_batch_loss_and_gradient(tiny_model_dir, pairs, tmp_path):
    """``--embed-chunk`` (what ``tune`` uses to bound memory) changes how the batch is run, not what is learnt.

    The model is in eval mode (no dropout), so the chunked, checkpointed forward and backward must
    give the one-pass loss and every parameter's gradient; chunks of 3 rows split queries from
    their passages, so InfoNCE must still see the whole batch.
    """
    model, tokenizer = load_policybert(tiny_model_dir("gate", perturb=True))
    model.eval()
    examples = read_examples(pairs["train"], 3)
    results = []
    for chunk in (None, 3):
        cfg = ContrastiveConfig(out=tmp_path, train_group_size=4, temperature=0.05, embed_chunk=chunk)
        task = ContrastiveTask(tokenizer, examples, [], cfg, max_length=512)
        model.zero_grad(set_to_none=True)
        loss = task.loss(model, task.batch([0, 1, 2, 3], "0-0-0"))
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    (whole_loss, whole), (chunked_loss, chunked) = results
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-5)
    assert whole.keys() == chunked.keys() and len(whole) > 10
    for name, grad in whole.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # over 5 s in one process (tests/support/fast_loop.py)
def test_training_lowers_dev_loss(start_model, pairs, tmp_path):
    """The dev loss (held-out chunks, all dev passages as candidates) falls well below the start's.

    It would rise if the loss rewarded the wrong passage or stepped the wrong way. MRR is not
    asserted: a 2-layer, hidden-32 model's rankings get worse before they get better (measured,
    40 steps: dev MRR@10 0.26 → 0.26 from this start, 0.58 → 0.38 from the random model, whose
    nearly parallel vectors still rank by shared characters until training spreads them).
    """
    cfg = ContrastiveConfig(out=tmp_path, temperature=0.05, query_instruction="")
    model, tokenizer = load_policybert(start_model)
    with torch.no_grad():
        before = ContrastiveTask(tokenizer, [], read_examples(pairs["dev"], 0), cfg, 128).evaluate(model)
    flags = [
        "--max-steps",
        "40",
        "--lr",
        "2e-3",
        "--batch-size",
        "8",
        "--train-group-size",
        "4",
        "--temperature",
        "0.05",
    ]
    flags += ["--query-instruction", ""]  # 19 shared characters would dominate a 32-character query in a tiny model
    out = run(start_model, pairs, tmp_path / "run", *flags)
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    after = metrics[-1]["held_out"]
    assert metrics[0]["held_out"] == before, "record 0 scores the start model"
    assert after["dev_queries"] == before["dev_queries"] > 30
    assert after["dev_loss"] < before["dev_loss"] - 0.3, (before, after)


def test_freeze_chars_trains_only_the_word_side(tiny_model_dir, pairs, tmp_path):
    start = tiny_model_dir("attn", perturb=True)
    out = run(start, pairs, tmp_path / "run", "--freeze-chars", "--max-steps", "3", "--lr", "1e-3", "--batch-size", "4")
    before, after = load_file(start / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    chars = [k for k in before if k.startswith(("embeddings.", "encoder."))]
    words = [k for k in before if k.startswith(("word_embeddings.", "word_encoder.", "fusions.", "fusion_scales"))]
    assert chars and all(torch.equal(before[k], after[k]) for k in chars)
    assert "fusion_scales" in words
    changed = {k for k in words if not torch.equal(before[k], after[k])}
    for part in ("word_embeddings.", "word_encoder.", "fusions.", "fusion_scales"):
        assert any(k.startswith(part) for k in changed), part


@pytest.mark.parametrize("fusion", [None, "attn"])
def test_freeze_piece_embeddings_keeps_only_the_piece_matrix(fusion, tiny_model_dir, pairs, tmp_path):
    """The start's token-piece rows stay bit-identical (no gradient, no AdamW state); the layers, and a word
    stream's own word embeddings, still train."""
    start = tiny_model_dir(fusion, perturb=True)
    flags = ["--freeze-piece-embeddings", "--max-steps", "2", "--lr", "1e-3", "--batch-size", "4"]
    out = run(start, pairs, tmp_path / "run", *flags)
    before, after = load_file(start / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    pieces = next(k for k in before if k.removeprefix("bert.") == "embeddings.word_embeddings.weight")
    assert torch.equal(before[pieces], after[pieces])
    moved = {k.removeprefix("bert.") for k in before if not torch.equal(before[k], after[k])}
    assert any(k.startswith("encoder.layer.") for k in moved)
    if fusion:
        assert "word_embeddings.word_embeddings.weight" in moved


def test_fusion_scale_lr_moves_s_at_its_own_rate(tiny_model_dir, pairs, tmp_path):
    """One AdamW step moves each parameter by about its group's learning rate (the first step is
    lr * g / (|g| + eps)): s by --fusion-scale-lr, everything else by at most --lr."""
    start = tiny_model_dir("attn", perturb=True)
    flags = ["--max-steps", "1", "--lr", "1e-5", "--warmup-proportion", "0", "--batch-size", "4", "--weight-decay", "0"]
    plain = run(start, pairs, tmp_path / "plain", *flags)
    fast = run(start, pairs, tmp_path / "fast", *flags, "--fusion-scale-lr", "1e-2")
    before = load_file(start / "model.safetensors")
    for out, scale_lr in ((plain, 1e-5), (fast, 1e-2)):
        after = load_file(out / "final" / "model.safetensors")
        moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
        assert moved["fusion_scales"] == pytest.approx(scale_lr, rel=1e-2), out
        assert max(m for k, m in moved.items() if k != "fusion_scales") <= 1.01e-5, out


def test_fusion_scale_lr_needs_a_word_stream(tiny_model_dir, pairs, tmp_path, capsys):
    argv = [
        "--model",
        str(tiny_model_dir(None)),
        "--train",
        str(pairs["train"]),
        "--dev",
        str(pairs["dev"]),
        "--out",
        str(tmp_path / "run"),
        "--device",
        "cpu",
        "--max-steps",
        "1",
        "--fusion-scale-lr",
        "1e-2",
    ]
    assert run_cli(main, argv) == 2
    assert "--fusion-scale-lr 0.01: BertModel has no fusion scales" in capsys.readouterr().err


def test_output_loads_for_serving_and_resume_is_exact(tiny_model_dir, pairs, tmp_path):
    start = tiny_model_dir("none", perturb=True)
    flags = ["--max-steps", "4", "--lr", "1e-3", "--batch-size", "4", "--checkpoint-every", "2"]
    straight = run(start, pairs, tmp_path / "straight", *flags)
    run(start, pairs, tmp_path / "resumed", *flags, "--stop-after", "2")
    assert not (tmp_path / "resumed" / "final").exists()
    resumed = run(start, pairs, tmp_path / "resumed", *flags, "--resume")
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], load_file(start / "model.safetensors")[k]) for k in a)

    vectors = np.array(
        PolicyBertEmbeddings(straight / "final").embed_documents(["国务院关于数据要素的意见", "住房公积金"])
    )
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0)


@pytest.mark.parametrize(
    "line, flags, message",
    [
        ('{"query": "a", "pos": []}', [], r"bad\.jsonl:2: not a pairs line"),
        ('{"query": "a", "pos": ["b"], "neg": [3]}', [], r"bad\.jsonl:2: not a pairs line"),
        ("not json", [], r"bad\.jsonl:2: not a pairs line \(JSONDecodeError\)"),
        ('{"query": "a", "pos": ["b"]}', [], r"bad\.jsonl:2: no negatives.*--train-group-size 1"),
        (
            '{"query": "a", "pos": ["b"], "neg": ["c"]}',
            ["--temperature", "0"],
            r"--temperature 0\.0: expected a number above 0",
        ),
        (
            '{"query": "a", "pos": ["b"], "neg": ["c"]}',
            ["--train-group-size", "0"],
            r"--train-group-size 0: expected a number above 0",
        ),
    ],
)
def test_bad_input_is_one_line_error(tiny_model_dir, pairs, tmp_path, capsys, line, flags, message):
    good = pairs["train"].read_text(encoding="utf-8").splitlines()[0]
    bad = write_jsonl([json.loads(good)], tmp_path / "bad.jsonl")
    bad.write_text(bad.read_text(encoding="utf-8") + line + "\n", encoding="utf-8")
    argv = [
        "--model",
        str(tiny_model_dir("none")),
        "--train",
        str(bad),
        "--dev",
        str(pairs["dev"]),
        "--out",
        str(tmp_path / "o"),
    ]
    assert run_cli(main, [*argv, "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "o" / "final").exists()


def test_freeze_chars_without_a_word_stream_is_refused(tiny_model_dir, pairs, tmp_path, capsys):
    argv = ["--model", str(tiny_model_dir(None)), "--train", str(pairs["train"]), "--dev", str(pairs["dev"])]
    assert run_cli(main, [*argv, "--out", str(tmp_path), "--freeze-chars", "--device", "cpu"]) == 2
    assert "--freeze-chars needs a PolicyBERT model with a word stream" in capsys.readouterr().err


# --- two processes (gloo): every query sees both processes' passages -------------------------------

WORLD, LOCAL_QUERIES, GROUP, DIM, TEMPERATURE = 2, 2, 3, 8, 0.05


def global_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Both processes' queries and passages, drawn from one seed so that every process can rebuild them."""
    generator = torch.Generator().manual_seed(7)
    queries = F.normalize(torch.randn(WORLD * LOCAL_QUERIES, DIM, generator=generator), dim=-1)
    passages = F.normalize(torch.randn(WORLD * LOCAL_QUERIES * GROUP, DIM, generator=generator), dim=-1)
    return queries, passages


def distributed_step(rank: int, port: int, out: str) -> None:
    """One process: InfoNCE on its own slice, backward; saves its loss and its passages' gradient."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        queries, passages = global_inputs()
        size = LOCAL_QUERIES * GROUP
        q = queries[rank * LOCAL_QUERIES : (rank + 1) * LOCAL_QUERIES].clone().requires_grad_()
        p = passages[rank * size : (rank + 1) * size].clone().requires_grad_()
        loss = info_nce(q, p, GROUP, TEMPERATURE)
        loss.backward()
        torch.save({"loss": loss.detach(), "passage_grad": p.grad, "query_grad": q.grad}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two processes in a gloo process group, as under torchrun
@pytest.mark.distributed
def test_cross_device_step_uses_both_processes_passages(tmp_path):
    mp.spawn(distributed_step, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]
    queries, passages = global_inputs()
    size = LOCAL_QUERIES * GROUP
    for rank, result in enumerate(results):
        local = queries[rank * LOCAL_QUERIES : (rank + 1) * LOCAL_QUERIES]
        positives = [rank * size + i * GROUP for i in range(LOCAL_QUERIES)]
        # 2 × the candidates: the hand-computed loss over all WORLD × size passages, not the local size.
        assert len(passages) == WORLD * size
        assert result["loss"].item() == pytest.approx(
            hand_info_nce(local, passages, positives, TEMPERATURE).item(), rel=1e-5
        )
        alone = info_nce(local, passages[rank * size : (rank + 1) * size], GROUP, TEMPERATURE)
        assert result["loss"].item() > alone.item() + 1e-3

    # Gradients: each process's passages get the gradient of the SUM of all processes' losses
    # (DDP then averages), i.e. exactly the gradient of the one-process loss over the global batch.
    q, p = queries.clone().requires_grad_(), passages.clone().requires_grad_()
    (WORLD * info_nce(q, p, GROUP, TEMPERATURE)).backward()
    for rank, result in enumerate(results):
        assert torch.allclose(result["passage_grad"], p.grad[rank * size : (rank + 1) * size], atol=1e-5)
        assert torch.allclose(
            result["query_grad"], q.grad[rank * LOCAL_QUERIES : (rank + 1) * LOCAL_QUERIES], atol=1e-5
        )


def test_false_negatives_are_counted_in_a_warning(tmp_path, capsys):
    path = tmp_path / "own.jsonl"
    lines = [
        {
            "query": "数据要素",
            "pos": ["数据要素市场"],
            "neg": ["完善数据要素的市场化配置"],
        },  # the negative holds the query
        {
            "query": "个人信息",
            "pos": ["个人信息保护法"],
            "neg": ["个人信息保护法", "另一段"],
        },  # a negative equals the positive
        {"query": "住房保障", "pos": ["保障性住房建设"], "neg": ["城市交通规划"]},
    ]
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    assert len(read_examples(path, 1)) == 3, "warned about, still trained on"
    err = capsys.readouterr().err
    assert (
        f"warning: {path}: 2 of 3 pairs have a negative that contains the query or equals a positive (first: pair 1)"
        in err
    )
    path.write_text(json.dumps(lines[2], ensure_ascii=False) + "\n", encoding="utf-8")
    read_examples(path, 1)
    assert "warning" not in capsys.readouterr().err


def test_the_training_function_saves_its_instruction_with_any_caller(tiny_model_dir, pairs, tmp_path):
    """``tune`` calls ``contrastive()`` and saves the model itself: the instruction must come with the tokenizer."""
    model, tokenizer = load_policybert(tiny_model_dir("attn"))
    cfg = ContrastiveConfig(
        out=tmp_path / "run", query_instruction="检索：", max_steps=1, batch_size=4, train_group_size=2, device="cpu"
    )
    contrastive(model, tokenizer, read_examples(pairs["train"], 1), read_examples(pairs["dev"], 0), cfg)
    saved = save_model_dir(model, tokenizer, tmp_path / "final")
    assert PolicyBertEmbeddings(saved).query_instruction == "检索："


def test_query_instruction_is_saved_and_served(tiny_model_dir, pairs, tmp_path):
    """``--query-instruction X`` is saved with the model, and the embeddings that the hook and ``serve``
    build (``load_embeddings`` from a settings block) and that ``eval`` builds prefix queries with X."""
    instruction = "请检索与此问题相关的政策条文："
    flags = ["--query-instruction", instruction, "--max-steps", "2", "--batch-size", "4", "--train-group-size", "2"]
    final = run(tiny_model_dir("attn", perturb=True), pairs, tmp_path / "run", *flags) / "final"
    prompts = json.loads((final / PROMPTS_FILE).read_text(encoding="utf-8"))
    assert prompts["prompts"]["query"] == instruction
    query = "数据安全管理办法适用于哪些单位？"
    hook = load_embeddings(LocalEmbeddingsConfig(model_path=str(final)), tmp_path, "policybert")
    for served in (hook, PolicyBertEmbeddings(final)):
        assert served.embed_query(query) == served.embed_documents([instruction + query])[0]
        assert served.embed_query(query) != served.embed_documents([DEFAULT_QUERY_INSTRUCTION + query])[0]
    check_loads_outside_chatchat(final, query_prompt=instruction)


def test_an_e5_shaped_start_trains_on_the_vectors_it_serves(tiny_model_dir, pairs, tmp_path):
    """A mean-pooled start with ``query: `` / ``passage: `` prompts: the task's vectors are the served ones (mean,
    passages with their prompt), and ``final/`` keeps the pooling and both prompts (no --query-instruction given)."""
    start = tmp_path / "e5-shaped"
    shutil.copytree(tiny_model_dir(None, perturb=True), start)
    (start / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}), encoding="utf-8")
    prompts = {"prompts": {"query": "query: ", "document": "passage: "}}
    (start / PROMPTS_FILE).write_text(json.dumps(prompts), encoding="utf-8")
    config = json.loads((start / "config.json").read_text(encoding="utf-8"))
    del config[FILES_KEY]  # edited by hand, as the hub's e5 directory: no record of its files
    (start / "config.json").write_text(json.dumps(config), encoding="utf-8")
    model, tokenizer = load_policybert(start)
    cfg = ContrastiveConfig(out=tmp_path / "unused", device="cpu")
    task = ContrastiveTask(tokenizer, [], read_examples(pairs["dev"], 0), cfg, 512)
    served = PolicyBertEmbeddings(start)
    texts = ["数据安全管理办法适用于哪些单位？", "促进数字经济和实体经济深度融合。"]
    with torch.no_grad():
        passages = task.embed(model, [tokenizer.document_prompt + t for t in texts]).numpy()
        queries = task.embed(model, task.dev_queries[:2]).numpy()
    assert np.abs(passages - served.encode_corpus(texts)).max() < 1e-6
    dev_questions = [q.removeprefix("query: ") for q in task.dev_queries[:2]]
    assert np.abs(queries - served.encode_queries(dev_questions)).max() < 1e-6
    final = run(start, pairs, tmp_path / "run", "--max-steps", "1", "--batch-size", "4", "--train-group-size", "2")
    trained = PolicyBertEmbeddings(final / "final")
    assert (trained.pooling, trained.query_instruction, trained.document_instruction) == (
        "mean",
        "query: ",
        "passage: ",
    )
