"""FlexAttention and regional compilation (zoo.parallel, zoo.models.backbone) as a specification.

FlexAttention's `BlockMask` is the group rule of `zoo.batch` (its dense form equals `group_attention_mask`,
and it skips the blocks nobody sees), and the backbone's outputs through it equal SDPA's on packed rows of
several documents, bidirectional groups and padding. torch 2.11 has no FlexAttention backward on the CPU, so
the gradients of the flex path are checked only by `benchmarks/gpu_check.py` on a GPU; training with it on
the CPU is refused by name. `Parallelism(compile=True)` compiles each block and trains exactly like eager
(the fast test traces with the "aot_eager" backend; inductor's C++ codegen takes minutes on two cores).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from zoo.batch import IGNORE_INDEX, PAD_DOC, GroupBatch, Modality, group_mask_mod
from zoo.models.backbone import UnifiedTransformer
from zoo.parallel import Parallelism, parallelize
from zoo.registry import create_model

SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, expert_hidden=16, top_k=2)


def packed_batch(rows: int = 2, length: int = 300, seed: int = 0) -> GroupBatch:
    """Rows packed with documents of 20-120 positions, each a run of groups of 1-12 positions (text tokens,
    visual scales), ending in padding; text ids throughout (the mask does not look at modalities)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((rows, length), PAD_DOC)
    group = torch.zeros(rows, length, dtype=torch.long)
    for r in range(rows):
        at, d = 0, 0
        while True:
            n = int(torch.randint(20, 120, (1,), generator=g))
            if at + n > length - 7:  # leave some padding at the end of every row
                break
            doc[r, at : at + n] = d
            i, gid = 0, 0
            while i < n:
                size = int(torch.randint(1, 13, (1,), generator=g))
                group[r, at + i : at + min(i + size, n)] = gid
                i, gid = i + size, gid + 1
            at, d = at + n, d + 1
    positions = torch.arange(length).expand(3, rows, length).clone()
    modality = torch.where(doc == PAD_DOC, int(Modality.PAD), int(Modality.TEXT))
    ids = torch.randint(10, 60, (rows, length), generator=g)
    # Each position predicts the next one of its document (a loss to train on; the mask is what is tested).
    targets = ids.roll(-1, dims=1)
    targets[(doc != doc.roll(-1, dims=1)) | (doc == PAD_DOC)] = IGNORE_INDEX
    return GroupBatch(
        input_ids=ids, modality=modality, group_id=group, doc_id=doc, positions=positions,
        targets={"text": targets},
    )


def test_the_block_masks_dense_form_is_the_group_attention_mask():
    batch = packed_batch()
    rows, length = batch.doc_id.shape
    dense = create_mask(group_mask_mod(batch.doc_id, batch.group_id), rows, 1, length, length, device="cpu")
    assert torch.equal(dense, batch.attention_mask())
    assert len(batch.doc_id[0].unique()) > 3 and int(batch.group_id.max()) > 5  # a real packing


def test_the_block_mask_skips_blocks_no_position_sees():
    batch = packed_batch(rows=1, length=1024)
    block_mask = UnifiedTransformer.block_mask(batch)
    # Documents of <= 120 positions in 128-position blocks: most blocks hold no visible pair at all.
    assert block_mask.sparsity() > 50.0


def test_flex_attention_gives_the_sdpa_outputs_on_packed_documents_and_groups():
    torch.manual_seed(0)
    model = create_model("tiny", **SHAPE, max_seq_len=300).eval()
    batch = packed_batch()
    with torch.no_grad():
        sdpa = model.forward_hidden(batch).hidden
        parallelize(model, Parallelism(attention="flex"))
        assert model.backbone.attention_backend == "flex"
        flex = model.forward_hidden(batch).hidden
    valid = batch.valid
    assert torch.allclose(flex[valid], sdpa[valid], atol=1e-5, rtol=1e-5)


def test_training_with_flex_attention_on_the_cpu_is_refused_by_name():
    torch.manual_seed(0)
    model = parallelize(create_model("tiny", **SHAPE, max_seq_len=300), Parallelism(attention="flex"))
    with pytest.raises(ValueError, match="attention='flex'.*cannot train on the CPU"):
        model(packed_batch())


def test_an_unknown_attention_backend_is_refused():
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'flex'"):
        Parallelism(attention="flash")  # type: ignore[arg-type]


def build_model():  # noqa: ANN201
    torch.manual_seed(0)
    return create_model("tiny", **SHAPE, max_seq_len=300)


def test_compile_compiles_every_block_in_place_and_keeps_the_parameter_names():
    eager = build_model()
    compiled = parallelize(build_model(), Parallelism(compile=True, activation_checkpointing=True))
    blocks = [*compiled.backbone.layers, *(module.block for module in compiled.text_head.mtp)]
    assert all(block._compiled_call_impl is not None for block in blocks)
    names = [name.replace("_checkpoint_wrapped_module.", "") for name in compiled.state_dict()]
    assert names == list(eager.state_dict())  # checkpoints and the hub read the same keys


@pytest.mark.slow  # ~15 s of tracing on an idle core, 45 s on a loaded machine
def test_regionally_compiled_blocks_train_like_eager():
    eager = build_model()
    compiled = parallelize(build_model(), Parallelism(compile=True, compile_backend="aot_eager"))
    batch = packed_batch(seed=3)
    losses = []
    for model in (eager, compiled):
        out = model(batch)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7), name
