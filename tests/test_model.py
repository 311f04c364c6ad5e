"""DLRM (docs/contract.md §7) with TorchRec's EmbeddingBagCollection and with ours (plain
tensors in, or through TorchRec's interface), and the CTR metrics."""

import math

import pytest
import torch
from torchrec import KeyedTensor

from dlrm import metrics
from dlrm.mixed_precision import MixedPrecisionTrainer, StaticScaler
from dlrm.model import DLRM, PRESETS, SPARSE_KEYS, TABLE_NAMES, DotInteraction
from dlrm.torchrec_adapter import kjt_from_ids, make_torchrec_ebc
from embcache.collection import CachedLowPrecisionEmbeddingBagCollection
from embcache.multi_table import BagTable, CachedLowPrecisionEmbeddingBags

ROWS = [3 + k for k in range(26)]


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(n, seed):
    """A learnable toy problem: click iff dense[0] + (cat_0 is odd) > 1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randint(0, r, (n,), generator=gen) for r in ROWS], 1)
    dense = torch.rand(n, 13, generator=gen) * 1.5
    labels = ((dense[:, 0] + (ids[:, 0] % 2)) > 1.0).float()
    return dense, ids, labels


def _model(preset="kaggle", seed=0):
    torch.manual_seed(seed)
    dim = PRESETS[preset].embedding_dim
    return DLRM.from_preset(preset, make_torchrec_ebc(ROWS, dim, SPARSE_KEYS))


@pytest.mark.parametrize(
    "preset, dim, top_in", [("kaggle", 16, 16 + 351), ("paper", 128, 128 + 351)]
)
def test_presets_and_shapes(preset, dim, top_in):
    model = _model(preset)
    assert model.embedding_dim == dim and model.top_mlp[0].in_features == top_in
    dense, ids, _ = _batch(5, 0)
    logits = model(dense, ids)
    assert logits.shape == (5,) and logits.dtype == torch.float32
    # ReLU after every bottom layer, between top layers only
    assert isinstance(model.bottom_mlp[-1], torch.nn.ReLU)
    assert isinstance(model.top_mlp[-1], torch.nn.Linear) and model.top_mlp[-1].out_features == 1


def test_torchrec_ebc_keys_and_output():
    ebc = make_torchrec_ebc(ROWS, 16, SPARSE_KEYS)
    dense, ids, _ = _batch(4, 1)
    kjt = kjt_from_ids(ids, SPARSE_KEYS)
    pooled = ebc(kjt)
    assert isinstance(pooled, KeyedTensor)
    assert pooled.keys() == list(SPARSE_KEYS) and pooled.values().shape == (4, 26 * 16)
    weight = ebc.embedding_bags["t_2"].weight
    assert weight.dtype == torch.float32 and weight.shape == (ROWS[2], 16)
    assert torch.equal(pooled.to_dict()["cat_2"], weight[kjt.to_dict()["cat_2"].values()])


def test_interaction_equals_naive_loop():
    gen = torch.Generator().manual_seed(2)
    batch, n, d = 3, 5, 4
    x, emb = (
        torch.randn(batch, d, generator=gen, dtype=torch.float64),
        torch.randn(batch, n, d, generator=gen, dtype=torch.float64),
    )
    out = DotInteraction(n)(x, emb)
    vectors = [x] + [emb[:, k] for k in range(n)]
    naive = [x] + [
        (vectors[i] * vectors[j]).sum(1, keepdim=True) for i in range(n + 1) for j in range(i)
    ]
    assert out.shape == (batch, d + (n + 1) * n // 2)
    torch.testing.assert_close(out, torch.cat(naive, 1), rtol=1e-12, atol=1e-12)


def test_fp16_interaction_is_an_fp32_product_rounded_once():
    gen = torch.Generator().manual_seed(3)
    x, emb = torch.randn(6, 8, generator=gen).half(), torch.randn(6, 26, 8, generator=gen).half()
    interaction = DotInteraction(26)
    out = interaction(x, emb)
    assert out.dtype == torch.float16
    assert torch.equal(out, interaction(x.float(), emb.float()).half())


def test_wrong_embedding_width_is_rejected():
    model = DLRM.from_preset("kaggle", make_torchrec_ebc(ROWS, 8, SPARSE_KEYS))
    dense, ids, _ = _batch(2, 0)
    with pytest.raises(ValueError, match="width"):
        model(dense, ids)
    bags = [BagTable(name, n, 8) for name, n in zip(TABLE_NAMES, ROWS)]
    with pytest.raises(ValueError, match="width"):  # known when it is built
        DLRM.from_preset("kaggle", CachedLowPrecisionEmbeddingBags(bags, precision="fp32"))


def test_our_tables_give_torchrecs_logits_and_gradients_by_either_interface():
    """The same FP32 rows as TorchRec's collection, in our torch-only module (the ids as a
    tensor) and in our TorchRec adapter (a KeyedJaggedTensor): the same logits, and, after one
    SGD step of lr 1, the same rows -- so the plain-tensor path feeds each feature its own
    table, in order."""
    torch.manual_seed(4)
    ebc = make_torchrec_ebc(ROWS, 16, SPARSE_KEYS)
    weights = {t: {"weight": bag.weight.detach().clone()} for t, bag in ebc.embedding_bags.items()}
    bags = [BagTable(name, n, 16, (key,)) for name, n, key in zip(TABLE_NAMES, ROWS, SPARSE_KEYS)]
    options = dict(per_table=weights, precision="fp32", cache_ratio=0, optimizer="sgd", lr=1.0)
    ours = {
        "plain": CachedLowPrecisionEmbeddingBags(bags, **options),
        "keyed": CachedLowPrecisionEmbeddingBagCollection.from_bag_tables(bags, **options),
    }
    dense, ids, _ = _batch(6, 5)
    models = {"torchrec": DLRM.from_preset("kaggle", ebc)}
    for kind, tables in ours.items():
        models[kind] = DLRM.from_preset("kaggle", tables)
        models[kind].load_state_dict(
            {k: v for k, v in models["torchrec"].state_dict().items() if "embedding" not in k},
            strict=False,
        )
    logits = {kind: m(dense, ids) for kind, m in models.items()}
    for kind in ours:
        torch.testing.assert_close(logits[kind], logits["torchrec"], rtol=0, atol=0)
    for out in logits.values():
        (out * torch.arange(1.0, 7.0)).sum().backward()
    with torch.no_grad():
        for bag in ebc.embedding_bags.values():
            bag.weight -= bag.weight.grad
    for tables in ours.values():
        tables.step()
        for name, table in tables.embedding_bags.items():
            expected = ebc.embedding_bags[name].weight.detach()
            torch.testing.assert_close(table.current_weight(), expected, rtol=0, atol=0)


def test_fp16_model_has_fp16_params_fp32_masters_and_fp16_gradients():
    model = _model()
    trainer = MixedPrecisionTrainer(model, dense_precision="fp16")
    ebc_params = set(model.embedding_collection.parameters())
    dense_params = [p for p in model.parameters() if p not in ebc_params]
    assert dense_params == trainer.dense_params and len(dense_params) == 2 * (4 + 3)
    assert all(p.dtype == torch.float16 for p in dense_params)
    assert all(m.dtype == torch.float32 for m in trainer.masters)
    assert all(torch.equal(p, m.half()) for p, m in zip(dense_params, trainer.masters))
    assert all(p.dtype == torch.float32 for p in ebc_params)

    dense, ids, labels = _batch(8, 0)
    model(dense, ids).sum().backward()
    assert all(p.grad.dtype == torch.float16 for p in dense_params)
    assert all(p.grad.dtype == torch.float32 for p in ebc_params)
    model.zero_grad(set_to_none=True)

    trainer.train_step(dense, ids, labels)
    assert all(torch.equal(p, m.half()) for p, m in zip(dense_params, trainer.masters))


def _eval_loss(model, data):
    with torch.no_grad():
        return metrics.log_loss(data[2], model(data[0], data[1]))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_dlrm_with_torchrec_ebc_learns(precision):
    model = _model(seed=1)
    trainer = MixedPrecisionTrainer(model, dense_precision=precision, optimizer="sgd", lr=0.2)
    assert isinstance(trainer.scaler, StaticScaler) == (precision == "fp32")
    held_out = _batch(512, 99)
    before = _eval_loss(model, held_out)
    for step in range(50):
        result = trainer.train_step(*_batch(64, step))
        assert not result["skipped"]
    after = _eval_loss(model, held_out)
    assert after < before - 0.15
    with torch.no_grad():  # always predicting the majority class scores 2/3
        assert metrics.accuracy(held_out[2], model(held_out[0], held_out[1])) > 0.75


# --------------------------------------------------------------------------- metrics


def test_auc_and_accuracy_hand_checked():
    labels = [0, 0, 1, 1]
    logits = [-2.0, 0.5, 0.0, 3.0]  # positives outrank 3 of the 4 (positive, negative) pairs
    assert metrics.auc(labels, logits) == pytest.approx(0.75)
    # predictions: 0, 1, 0 (p = 0.5 is no click), 1
    assert metrics.accuracy(torch.tensor(labels), torch.tensor(logits)) == pytest.approx(0.5)


def test_log_loss_and_normalized_entropy_hand_checked():
    labels = [1, 0, 0, 0]
    logits = [0.0, 0.0, math.log(1 / 3), -100.0]  # p = 1/2, 1/2, 1/4, ~0
    expected = (math.log(2) + math.log(2) + math.log(4 / 3) + 0.0) / 4
    assert metrics.log_loss(labels, logits) == pytest.approx(expected, rel=1e-12)
    base_entropy = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert metrics.normalized_entropy(labels, logits) == pytest.approx(
        expected / base_entropy, rel=1e-12
    )
    # predicting the base rate everywhere gives NE = 1
    assert metrics.normalized_entropy(labels, [math.log(1 / 3)] * 4) == pytest.approx(
        1.0, rel=1e-12
    )
    with pytest.raises(ValueError, match="undefined when only one class is present"):
        metrics.normalized_entropy([1, 1], [0.0, 0.0])


def test_relative_accuracy_drop_and_evaluate():
    assert metrics.relative_accuracy_drop(0.8, 0.79) == pytest.approx(1.25)
    assert metrics.relative_accuracy_drop(0.8, 0.81) < 0
    assert metrics.relative_accuracy_drop(0.789, 0.7889) < metrics.NEUTRAL_DROP_PERCENT
    result = metrics.evaluate([0, 1, 1, 0], [-1.0, 2.0, 0.5, 1.0])
    assert set(result) == {"auc", "accuracy", "log_loss", "normalized_entropy", "undefined"}
    assert result["undefined"] == {}
    assert result["auc"] == pytest.approx(0.75) and result["accuracy"] == pytest.approx(0.75)
