"""Training DFlash 2 drafters in JAX, float32 on CPU: the training forward (all anchors' blocks
in one pass) drafts what the inference path drafts at each anchor, the convolutions never
crossing blocks; a drafter grown from a DFlash-1 drafter drafts as it did until trained; the
selector's teacher-forced loss against a plain numpy reference; training lowers it and stays
lossless; the CLI trains, exports and loads one."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dflash_jax
from dflash_jax import cli
from dflash_jax.checkpoint import save_checkpoint
from dflash_jax.config import DFlash2Config
from dflash_jax.formats.hf_config import to_hf_config
from dflash_jax.train.evaluate import speculative_greedy
from dflash_jax.train.forward import block_drafts, block_logits
from dflash_jax.train.init import with_dflash2
from dflash_jax.train.loss import selector_loss_terms, slot_weights
from dflash_jax.train.step import Hyperparams, drafter_params, make_optimizer
from dflash_jax.train.trainer import train_drafter
from test_train_forward import DRAFTER, tiny_pair
from dflash_jax.train.data import save_dataset
from test_train_loop import dense_greedy, greedy_dataset

DFLASH2 = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)


def tiny_dflash2_pair():
    return tiny_pair(architectures=["DFlash2DraftModel"], dflash_config={**DRAFTER["dflash_config"], **DFLASH2})


def test_training_forward_drafts_as_the_inference_path():
    target, drafter = tiny_dflash2_pair()
    ids = np.random.default_rng(0).integers(0, 63, size=24)
    _, features = dflash_jax.target_forward(target, ids, layer_ids=drafter.cfg.target_layer_ids)
    anchors = np.array([0, 9, 23, 2, 10])  # 9 and 10: overlapping blocks the convolutions must keep apart
    logits = np.asarray(block_logits(target, drafter, ids, features, anchors))
    drafts = np.asarray(block_drafts(target, drafter, ids, features, anchors))
    for a, p in enumerate(anchors):
        block = [int(ids[p])] + [63] * 3
        np.testing.assert_allclose(logits[a], dflash_jax.draft_logits(target, drafter, features[:p], block),
                                   rtol=1e-5, atol=1e-5)
        path, _, _ = dflash_jax.draft_path(target, drafter, features[:p], block)
        np.testing.assert_array_equal(drafts[a], np.asarray(path))


def test_grown_drafter_drafts_as_its_dflash1_drafter_until_trained():
    target, drafter = tiny_pair()
    grown = with_dflash2(drafter, DFlash2Config(**DFLASH2), seed=3)
    assert grown.cfg.dflash2 == DFlash2Config(**DFLASH2)
    ids = np.random.default_rng(1).integers(0, 63, size=20)
    _, features = dflash_jax.target_forward(target, ids, layer_ids=drafter.cfg.target_layer_ids)
    anchors = np.array([1, 7, 12])
    np.testing.assert_allclose(block_logits(target, grown, ids, features, anchors),
                               block_logits(target, drafter, ids, features, anchors), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(block_drafts(target, grown, ids, features, anchors),
                                  block_drafts(target, drafter, ids, features, anchors))
    with pytest.raises(ValueError, match="DFlash 2 drafter already"):
        with_dflash2(grown, DFlash2Config(**DFLASH2))


def test_adamw_decays_matrices_but_not_the_selector_codebooks():
    """One step of zero gradients: only decayed parameters move (by lr x decay x value)."""
    import jax

    _, drafter = tiny_dflash2_pair()
    params = drafter_params(drafter)
    hp = Hyperparams(learning_rate=0.1, weight_decay=0.5, warmup_ratio=0.0, total_steps=10)
    optimizer = make_optimizer(hp)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    moved = {jax.tree_util.keystr(path): bool(jnp.any(u != 0))
             for path, u in jax.tree_util.tree_leaves_with_path(updates)}
    assert any("codebook" in name for name in moved) and not any(v for k, v in moved.items() if "codebook" in k)
    assert any(v for k, v in moved.items() if "kernel" in k)  # the layers' matrices decay
    assert not any(v for k, v in moved.items() if "norm" in k)


def test_selector_loss_is_teacher_forced_cross_entropy_over_the_candidates():
    target, drafter = tiny_dflash2_pair()
    selector = drafter.candidate_selector
    rng = np.random.default_rng(2)
    A, N, V, D = 3, 4, 64, drafter.cfg.hidden_size
    hidden = rng.normal(size=(A, N, D)).astype(np.float32)
    logits = rng.normal(size=(A, N, V)).astype(np.float32)
    labels = rng.integers(0, V, (A, N))
    top = np.argsort(-logits, axis=-1)
    labels[0] = top[0, np.arange(N), [0, 4, 2, 1]]  # row 0: the true tokens among the candidates
    counted = np.ones((A, N), bool)
    counted[2, 3] = False
    anchors = rng.integers(0, V, A)
    weights = np.asarray(slot_weights(N + 1, 2.0))

    ce, weight, correct, seen = selector_loss_terms(selector, jnp.asarray(hidden), jnp.asarray(logits),
                                                    jnp.asarray(labels), jnp.asarray(counted), jnp.asarray(anchors),
                                                    jnp.asarray(weights))
    pred, succ = np.asarray(selector.predecessor_codebook[...]), np.asarray(selector.successor_codebook[...])
    proj = hidden @ np.asarray(selector.hidden_projection.kernel[...])
    want_ce = want_weight = 0.0
    want_correct, want_seen = np.zeros(N), np.zeros(N)
    for a in range(A):
        for n in range(N):
            candidates = top[a, n, :5]
            if not counted[a, n] or labels[a, n] not in candidates:
                continue
            previous = anchors[a] if n == 0 else labels[a, n - 1]
            scores = logits[a, n, candidates] + (pred[previous] * proj[a, n]) @ succ[candidates].T
            label = list(candidates).index(labels[a, n])
            log_z = np.log(np.sum(np.exp(scores - scores.max()))) + scores.max()
            want_ce += weights[n] * (log_z - scores[label])
            want_weight += weights[n]
            want_correct[n] += np.argmax(scores) == label
            want_seen[n] += 1
    assert want_seen.sum() >= 4  # row 0 at least
    np.testing.assert_allclose(float(ce), want_ce, rtol=1e-5)
    np.testing.assert_allclose(float(weight), want_weight, rtol=1e-6)
    np.testing.assert_array_equal(correct, want_correct)
    np.testing.assert_array_equal(seen, want_seen)


def test_a_frozen_backbone_trains_only_the_convolutions_and_the_selector(tmp_path):
    """Steps with weight decay and a frozen backbone: the DFlash-1 drafter's weights come back
    bit for bit, every DFlash 2 part moves (so the drafter is its base plus those parts)."""
    import jax

    target, dflash1 = tiny_pair()
    drafter = with_dflash2(dflash1, DFlash2Config(**DFLASH2))
    before = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(drafter_params(drafter))}
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=8, new_tokens=12)
    hp = Hyperparams(total_steps=3, learning_rate=1e-2, warmup_ratio=0.0, weight_decay=0.1, max_anchors=4,
                     compute_dtype="float32", frozen_backbone=True)
    result = train_drafter(target, drafter, dataset, hp, tmp_path / "run", batch_size=4, max_length=16,
                           progress=False)
    after = {jax.tree_util.keystr(p): np.asarray(x)
             for p, x in jax.tree_util.tree_leaves_with_path(drafter_params(result.drafter))}
    parts = [name for name in before if any(part in name for part in ("attention_conv", "mlp_conv", "candidate_selector"))]
    assert parts and len(parts) < len(before)
    for name in before:
        if name in parts:
            continue
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    assert all(np.any(after[name] != before[name]) for name in parts)
    unfrozen = dataclasses.replace(hp, total_steps=4, frozen_backbone=False)
    with pytest.raises(ValueError, match="trained with --frozen-backbone; resume with it"):
        train_drafter(target, drafter, dataset, unfrozen, tmp_path / "run", batch_size=4, max_length=16, progress=False)
    with pytest.raises(ValueError, match="this drafter is DFlash-1"):
        train_drafter(target, dflash1, dataset, hp, tmp_path / "dflash1", batch_size=4, max_length=16, progress=False)


def test_a_drafter_exported_over_its_base_holds_only_what_it_adds(tmp_path):
    """A DFlash 2 drafter grown from a DFlash-1 one (its backbone unchanged but one matrix)
    exported beside that drafter's sharded folder: the base's shards it holds bit for bit are
    relative links (no index path outside the folder, which HF loaders refuse), the shard of
    the changed matrix is not, its own shard holds the DFlash 2 parts and that shard's
    tensors, and it loads as itself; exported over itself, it writes no tensors at all."""
    from safetensors import safe_open

    from dflash_jax.formats.export_hf import export_hf

    target, dflash1 = tiny_pair()
    grown = with_dflash2(dflash1, DFlash2Config(**DFLASH2), seed=4)
    changed = grown.layers[0].mlp.down_proj.kernel
    changed[...] = changed[...] * 2
    export_hf(dflash1, tmp_path / "base", dtype="float32", max_shard_bytes=1)  # a tensor a shard
    base_map = json.loads((tmp_path / "base" / "model.safetensors.index.json").read_text())["weight_map"]
    export_hf(grown, tmp_path / "dflash2", dtype="float32", base=tmp_path / "base")
    weight_map = json.loads((tmp_path / "dflash2" / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (tmp_path / "dflash2" / "model.safetensors").exists()  # HF loaders would read it alone
    with safe_open(tmp_path / "dflash2" / "model-00001-of-00001.safetensors", framework="numpy") as handle:
        own = set(handle.keys())
    assert own == {name for name, file in weight_map.items() if file == "model-00001-of-00001.safetensors"}
    assert "layers.0.mlp.down_proj.weight" in own and "layers.0.self_attn.q_proj.weight" not in own
    assert all(any(part in name for part in ("conv", "selector", "codebook")) for name in own - {
        "layers.0.mlp.down_proj.weight"})
    links = {file for file in weight_map.values() if file.startswith("base-")}
    assert links == {f"base-{file}" for name, file in base_map.items() if name != "layers.0.mlp.down_proj.weight"}
    for link in links:
        path = tmp_path / "dflash2" / link
        assert path.is_symlink() and str(path.readlink()) == f"../base/{link.removeprefix('base-')}"
    loaded = dflash_jax.load_drafter(tmp_path / "dflash2", dtype="float32")
    ids = np.random.default_rng(2).integers(0, 63, size=16)
    _, features = dflash_jax.target_forward(target, ids, layer_ids=dflash1.cfg.target_layer_ids)
    np.testing.assert_array_equal(dflash_jax.draft_logits(target, loaded, features[:9], [int(ids[9])] + [63] * 3),
                                  dflash_jax.draft_logits(target, grown, features[:9], [int(ids[9])] + [63] * 3))
    export_hf(dflash1, tmp_path / "same", dtype="float32", base=tmp_path / "base")
    assert not list((tmp_path / "same").glob("model-*.safetensors"))
    assert dflash_jax.load_drafter(tmp_path / "same", dtype="float32").cfg == dflash1.cfg


@pytest.mark.slow
def test_training_a_grown_drafter_lowers_the_selector_loss_and_stays_lossless(tmp_path):
    target, dflash1 = tiny_pair()
    drafter = with_dflash2(dflash1, DFlash2Config(**DFLASH2))
    dataset = greedy_dataset(tmp_path / "data.npz", target, num_prompts=64)
    hp = Hyperparams(total_steps=120, learning_rate=3e-3, warmup_ratio=0.05, max_anchors=16)
    result = train_drafter(target, drafter, dataset, hp, tmp_path / "run", batch_size=8, max_length=48,
                           progress=False)
    losses = result.losses
    assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:10])
    trained = result.drafter
    assert trained.cfg.dflash2 == drafter.cfg.dflash2
    moved = [float(jnp.abs(layer.attention_conv.kernel_projection.kernel[...]).max()) for layer in trained.layers]
    assert min(moved) > 0 and float(jnp.abs(trained.candidate_selector.hidden_projection.kernel[...]).max()) > 0
    prompt = np.random.default_rng(1).integers(0, 63, 6).tolist()
    tokens, accepted = speculative_greedy(target, trained, prompt, 24)
    assert tokens == dense_greedy(target, [prompt], max_new_tokens=24).token_ids[0]
    assert max(accepted) > 1


def saved_pair(folder):
    """The tiny target and DFlash-1 drafter saved as `folder`/target and /dflash1, and a
    training set of the target's greedy answers as /data.npz."""
    target, dflash1 = tiny_pair()
    save_checkpoint(target, to_hf_config(target.cfg), folder / "target")
    save_checkpoint(dflash1, to_hf_config(dflash1.cfg), folder / "dflash1")
    greedy_dataset(folder / "data.npz", target, num_prompts=8, new_tokens=12)
    return target, dflash1


@pytest.mark.slow
def test_train_cli_grows_a_dflash2_drafter_and_exports_it(tmp_path, capsys):
    target, dflash1 = saved_pair(tmp_path)
    train = ["train-drafter", str(tmp_path / "target"), str(tmp_path / "data.npz"), str(tmp_path / "run"),
             "--drafter", str(tmp_path / "dflash1"), "--dflash2", "--conv-kernel-size", "2", "--conv-group-size", "8",
             "--selector-rank", "4", "--selector-top-k", "3", "--steps", "2", "--batch-size", "4",
             "--max-length", "16", "--max-anchors", "4"]
    bad_group = [*train]
    bad_group[bad_group.index("--conv-group-size") + 1] = "5"
    assert cli.main(bad_group) == 2
    assert "does not divide the hidden size 32" in capsys.readouterr().err
    assert cli.main(train) == 0
    exported = tmp_path / "run" / "drafter"
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert {k: config["dflash_config"][k] for k in DFLASH2} == dict(
        conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=3)
    loaded = dflash_jax.load_drafter(exported)
    assert loaded.cfg.dflash2 == DFlash2Config(2, 8, 4, 3) and loaded.cfg.num_layers == dflash1.cfg.num_layers
    assert "DFlash 2" in (exported / "README.md").read_text()


@pytest.mark.slow
def test_train_cli_resumes_a_dflash2_run_as_it_started_and_refuses_flags_that_disagree(tmp_path, capsys):
    target, dflash1 = saved_pair(tmp_path)
    shape = ["--conv-kernel-size", "2", "--conv-group-size", "8", "--selector-rank", "4", "--selector-top-k", "3"]
    common = ["--steps", "2", "--batch-size", "4", "--max-length", "16", "--max-anchors", "4", "--dtype", "float32"]

    def train(out, *flags, data="data.npz"):
        return cli.main(["train-drafter", str(tmp_path / "target"), str(tmp_path / data), str(tmp_path / out),
                         *flags, *common])

    assert train("loose", *shape) == 2
    assert "shape a DFlash 2 drafter; add --dflash2" in capsys.readouterr().err
    assert train("frozen", "--dflash2", "--frozen-backbone") == 2
    assert "pass --dflash2 and --drafter" in capsys.readouterr().err
    vocab = target.cfg.vocab_size
    save_dataset(tmp_path / "other.npz", [([1, 2, vocab], [False, True, True])] * 4, {"source": "another target"})
    assert train("other", "--drafter", str(tmp_path / "dflash1"), data="other.npz") == 2
    assert f"token id {vocab}, past" in capsys.readouterr().err

    # a new drafter, stopped before its first checkpoint (only its config written), then run again
    scratch = ["--dflash2", *shape, "--num-layers", "1", "--block-size", "4", "--mask-token-id", "63"]
    assert train("whole", *scratch) == 0
    (tmp_path / "resumed").mkdir()
    (tmp_path / "resumed" / "drafter_config.json").write_text((tmp_path / "whole" / "drafter_config.json").read_text())
    assert train("resumed", *scratch) == 0
    whole, resumed = (dflash_jax.load_drafter(tmp_path / run / "drafter", dtype="float32") for run in ("whole", "resumed"))
    for (name, a), (_, b) in zip(*(sorted(nnx.to_flat_state(nnx.state(d, nnx.Param))) for d in (whole, resumed))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(name))

    # a DFlash 2 --drafter keeps its shape; a grown run resumed with other shape flags is refused
    assert train("again", "--drafter", str(tmp_path / "whole" / "drafter"), "--dflash2", "--selector-top-k", "5") == 2
    assert "--selector-top-k 5 (the drafter's: 3)" in capsys.readouterr().err
    grown = with_dflash2(dflash1, DFlash2Config(3, 8, 4, 3))
    (tmp_path / "grown").mkdir()
    recorded = json.dumps(to_hf_config(grown.cfg))
    (tmp_path / "grown" / "drafter_config.json").write_text(recorded)
    assert train("grown", "--drafter", str(tmp_path / "dflash1"), "--dflash2", *shape) == 2
    assert "rerun with the first run's flags" in capsys.readouterr().err
    assert (tmp_path / "grown" / "drafter_config.json").read_text() == recorded
