"""Medusa heads (specmlx/drafting/heads/medusa.py) against the reference code.

The reference is FasterDecoding/Medusa's own ResBlock, head construction, buffers and
candidates (tests/reference/medusa_heads.py), run in PyTorch on the CPU: random heads saved
as the published layouts (torch.save'd state_dict, safetensors) must give the same logits in
MLX, with the head and layer counts read from the names; a changed layout or a pickle asking
for code is refused in one line; the sparse tree matches generate_medusa_buffers and
generate_candidates node by node."""

import collections
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specmlx.core.tree_acceptance import Tree
from specmlx.drafting.heads.medusa import (
    SMALL_CHOICES,
    MedusaHeads,
    load_medusa,
    medusa_top,
    medusa_tree,
    ranks_needed,
)
from specmlx.drafting.heads.torch_zip import read_torch_zip
from specmlx.errors import BadInput

sys.path.insert(0, str(Path(__file__).parent / "reference"))
import medusa_heads as reference  # noqa: E402

HIDDEN, VOCAB = 32, 50


def ref_heads(heads: int, layers: int, seed: int = 0) -> torch.nn.ModuleList:
    """Medusa's heads with random weights (its ResBlocks start at zero, an identity)."""
    torch.manual_seed(seed)
    model = reference.medusa_head(HIDDEN, VOCAB, heads, layers)
    with torch.no_grad():
        for p in model.parameters():  # a shared block is one parameter, drawn once
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def ref_logits(model: torch.nn.ModuleList, h: np.ndarray) -> np.ndarray:
    """(..., K, V) as MedusaModelABC.forward computes it (a stack over heads on axis 0),
    moved to our layout."""
    with torch.no_grad():
        out = torch.stack([head(torch.from_numpy(h)) for head in model], dim=0)
    return np.moveaxis(out.float().numpy(), 0, -2)


def save(model: torch.nn.ModuleList, path: Path, fmt: str) -> Path:
    """The heads' state_dict as Medusa writes it: torch.save (.pt) or safetensors."""
    state = model.state_dict()
    if fmt == "pt":
        torch.save(state, path / "medusa_lm_head.pt")
        return path / "medusa_lm_head.pt"
    # safetensors refuses tensors that share memory (a repeated ResBlock's): copies
    save_file({k: v.clone().contiguous() for k, v in state.items()}, path / f"x.{fmt}")
    (path / f"x.{fmt}").rename(path / "medusa_lm_head.safetensors")
    return path / "medusa_lm_head.safetensors"


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
@pytest.mark.parametrize("heads,layers", [(3, 1), (5, 1), (3, 2), (5, 2)])
def test_logits_equal_the_reference(tmp_path, fmt, heads, layers):
    model = ref_heads(heads, layers, seed=heads * 10 + layers)
    file = save(model, tmp_path, fmt)
    for where in (file, tmp_path):  # the file itself, or its directory
        ours = load_medusa(where)
        assert (ours.heads, ours.layers, ours.hidden, ours.vocab) == (heads, layers, HIDDEN, VOCAB)
        h = np.random.default_rng(1).standard_normal((2, 5, HIDDEN)).astype(np.float32)
        got = np.array(ours(mx.array(h)))
        assert got.shape == (2, 5, heads, VOCAB)
        np.testing.assert_allclose(got, ref_logits(model, h), rtol=1e-5, atol=1e-5)
    if layers == 2:  # Medusa repeats one block: its copies load equal
        np.testing.assert_array_equal(np.array(ours.res_weight[0]), np.array(ours.res_weight[1]))


@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_bfloat16_weights_load_bit_exact(tmp_path, fmt):
    model = ref_heads(3, 1).to(torch.bfloat16)
    ours = load_medusa(save(model, tmp_path, fmt))
    assert ours.out_weight.dtype == mx.bfloat16
    want = model.state_dict()
    for k in range(3):
        got = np.array(ours.out_weight[k].astype(mx.float32))
        np.testing.assert_array_equal(got, want[f"{k}.1.weight"].float().numpy())
        got = np.array(ours.res_bias[0, k].astype(mx.float32))
        np.testing.assert_array_equal(got, want[f"{k}.0.linear.bias"].float().numpy())


def test_a_strided_tensor_in_a_pt_reads_as_its_view(tmp_path):
    # torch.save keeps a view's storage, offset and strides: the rebuild must honour them
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    torch.save({"a": base[1:, 2:7].t(), "b": base[0]}, tmp_path / "v.pt")
    got = read_torch_zip(tmp_path / "v.pt")
    np.testing.assert_array_equal(np.array(got["a"]), base[1:, 2:7].t().numpy())
    np.testing.assert_array_equal(np.array(got["b"]), base[0].numpy())


def test_reading_a_pt_imports_no_torch(tmp_path):
    torch.save(ref_heads(3, 1).state_dict(), tmp_path / "medusa_lm_head.pt")
    code = (
        "import sys; from specmlx.drafting.heads.medusa import load_medusa; "
        f"m = load_medusa({str(tmp_path)!r}); assert m.heads == 3; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (torch importable here)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1], env=env)


def test_heads_module_shapes():
    mx.random.seed(0)
    m = MedusaHeads(HIDDEN, VOCAB, heads=4, layers=0)
    assert m(mx.zeros((HIDDEN,))).shape == (4, VOCAB)
    assert m(mx.zeros((1, 3, HIDDEN))).shape == (1, 3, 4, VOCAB)
    # layers 0: each head is its output layer alone
    h = mx.random.normal((HIDDEN,))
    np.testing.assert_allclose(np.array(m(h)), np.array(m.out_weight @ h), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- layouts refused


def tensors_of(model: torch.nn.ModuleList) -> dict[str, torch.Tensor]:
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "change,says",
    [
        (lambda t: {k.replace(".linear.", ".lin."): v for k, v in t.items()}, "0.0.lin.bias"),
        (lambda t: {f"medusa_head.{k}": v for k, v in t.items()}, "not a Medusa head's"),
        (lambda t: {k: v for k, v in t.items() if k != "1.0.linear.bias"}, "head 1's blocks"),
        (lambda t: {k: v for k, v in t.items() if not k.startswith("1.")}, "numbered [0, 2]"),
        (
            lambda t: {**t, "2.0.linear.weight": t["2.0.linear.weight"][:, :8].contiguous()},
            "expected",
        ),
        (lambda t: {**t, "1.1.weight": t["1.1.weight"][:40]}, "expected (50, 32)"),
        (lambda t: {**t, "0.1.weight": t["0.1.weight"].to(torch.int32)}, "not floating"),
        (lambda t: {}, "no tensors"),
    ],
)
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_a_changed_layout_is_refused(tmp_path, change, says, fmt):
    t = change(tensors_of(ref_heads(3, 1)))
    file = tmp_path / f"medusa_lm_head.{fmt}"
    if fmt == "pt":
        torch.save(t, file)
    elif t:
        save_file(t, file)
    else:
        file.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")  # an empty safetensors
    with pytest.raises(BadInput) as e:
        load_medusa(tmp_path)
    assert says in str(e.value) and str(file) in str(e.value)
    assert "\n" not in str(e.value)


def test_heads_with_unequal_depths_are_refused(tmp_path):
    t = tensors_of(ref_heads(2, 1))
    t["1.1.linear.weight"] = t["1.0.linear.weight"].clone()
    t["1.1.linear.bias"] = t["1.0.linear.bias"].clone()
    t["1.2.weight"] = t.pop("1.1.weight")
    save_file(t, tmp_path / "medusa_lm_head.safetensors")
    with pytest.raises(BadInput, match="head 1 has 2 blocks, head 0 has 1"):
        load_medusa(tmp_path)


def pt_with_pickle(path: Path, payload: bytes) -> Path:
    """A torch-zip-shaped file whose data.pkl is payload."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
    return path


class Calls:
    """Pickles as a call of fn(*args) (what a malicious checkpoint holds)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("how", ["by hand", "reduce", "inside a state_dict"])
def test_a_pickle_asking_for_code_is_refused_and_nothing_runs(tmp_path, how):
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    if how == "by hand":  # protocol 2: GLOBAL os.system, a 1-tuple, REDUCE
        payload = b"\x80\x02cos\nsystem\nX" + len(command).to_bytes(4, "little")
        payload += command.encode() + b"\x85R."
    elif how == "reduce":
        payload = pickle.dumps(Calls(os.system, command), protocol=2)
    else:  # an allowed global (OrderedDict) holding a call of eval
        state = collections.OrderedDict(x=Calls(eval, f"__import__('os').system({command!r})"))
        payload = pickle.dumps(state, protocol=2)
    file = pt_with_pickle(tmp_path / "medusa_lm_head.pt", payload)
    with pytest.raises(BadInput, match="refused, nothing run") as e:
        load_medusa(file)
    assert str(file) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    "content,says",
    [
        (b"not a zip at all", "not a torch zip checkpoint"),
        (pickle.dumps({"a": 1}), "not a torch zip checkpoint"),  # the pre-1.6 format's shape
    ],
)
def test_a_foreign_pt_is_refused(tmp_path, content, says):
    (tmp_path / "medusa_lm_head.pt").write_bytes(content)
    with pytest.raises(BadInput, match=says):
        load_medusa(tmp_path)


def test_a_damaged_pt_or_safetensors_is_refused(tmp_path):
    torch.save(ref_heads(3, 1).state_dict(), tmp_path / "good.pt")
    with (
        zipfile.ZipFile(tmp_path / "good.pt") as src,
        zipfile.ZipFile(tmp_path / "medusa_lm_head.pt", "w") as dst,
    ):
        for n in src.namelist():  # a storage cut short
            data = src.read(n)
            dst.writestr(n, data[:7] if n.endswith("data/1") else data)
    with pytest.raises(BadInput, match="unreadable torch checkpoint"):
        load_medusa(tmp_path / "medusa_lm_head.pt")
    # a state_dict of non-tensors
    pt_with_pickle(tmp_path / "other.pt", pickle.dumps({"a": 1}, protocol=2))
    with pytest.raises(BadInput, match="not a state_dict"):
        load_medusa(tmp_path / "other.pt")
    (tmp_path / "medusa_lm_head.safetensors").write_bytes(b"\xff" * 40)
    with pytest.raises(BadInput, match="not a readable safetensors file"):
        load_medusa(tmp_path)  # the directory prefers the safetensors
    with pytest.raises(BadInput, match="no such file"):
        load_medusa(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="holds no Medusa heads"):
        load_medusa(tmp_path / "empty")


# -------------------------------------------------------------------------- tree


def medusa_parents(buffers: dict) -> list[int]:
    """Each node's parent from Medusa's attention mask: its deepest ancestor (the largest
    index: ancestors come first, by depth)."""
    mask = buffers["medusa_attn_mask"][0, 0].numpy()
    out = []
    for i in range(1, mask.shape[0]):
        ancestors = [j for j in range(1, i) if mask[i, j]]
        out.append(max(ancestors, default=0))
    return out


def check_against_medusa(top: list[list[int]], choices) -> tuple[list[int], tuple[int, ...]]:
    tokens, parents = medusa_tree(top, choices)
    buffers = reference.generate_medusa_buffers([list(c) for c in choices], device="cpu")
    tree = Tree(parents)  # valid: every parent before its children
    assert list(parents) == medusa_parents(buffers)
    # Medusa's tokens: candidates = [root, head 0's top-10, head 1's top-10, ...] indexed
    # by tree_indices (node 0 the root)
    pad = [row + [-1] * (reference.TOPK - len(row)) for row in top]
    candidates = np.array([-7] + [t for row in pad for t in row])
    assert candidates[buffers["tree_indices"].numpy()].tolist() == [-7, *tokens]
    # depths: Medusa's position ids, and the choices' lengths in sorted order
    assert tree.depths() == buffers["medusa_position_ids"].tolist()
    assert tree.depths()[1:] == sorted(len(c) for c in choices)
    # Medusa's retrieve paths are exactly the root-to-leaf paths
    kids = tree.children()
    leaves = [n for n in range(1, tree.size + 1) if not kids[n]]
    rows = {tuple(x for x in r if x >= 0) for r in buffers["retrieve_indices"].tolist()}
    assert rows == {(0, *tree.path(n)) for n in leaves}
    # siblings distinct, in rank order
    for c in kids:
        assert len({tokens[n - 1] for n in c}) == len(c)
    return tokens, parents


def test_a_hand_built_tree_node_by_node():
    choices = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (2,)]  # not in Medusa's order
    top = [[10, 11, 12], [20, 21], [30]]
    tokens, parents = check_against_medusa(top, choices)
    # sorted: (0,) (1,) (2,) (0,0) (0,1) (1,0) (0,0,0)
    assert tokens == [10, 11, 12, 20, 21, 20, 30]
    assert parents == (0, 0, 0, 1, 1, 2, 4)


def test_the_small_and_full_default_trees_match_medusa():
    assert [list(c) for c in SMALL_CHOICES] == reference.mc_sim_7b_63[:16]
    rng = np.random.default_rng(3)
    for choices in (SMALL_CHOICES, reference.mc_sim_7b_63):
        depth = max(len(c) for c in choices)
        top = [rng.permutation(VOCAB)[:10].tolist() for _ in range(depth)]
        tokens, parents = check_against_medusa(top, choices)
        assert len(tokens) == len(choices)
    assert ranks_needed(SMALL_CHOICES) == [6, 6, 2]


def test_tokens_from_logits_equal_generate_candidates():
    # random heads' logits at the last position: our top-k and tree against Medusa's
    rng = np.random.default_rng(5)
    choices = reference.mc_sim_7b_63
    heads = 4
    medusa_logits = rng.standard_normal((heads, 1, 3, VOCAB)).astype(np.float32)
    logits = rng.standard_normal((1, 3, VOCAB)).astype(np.float32)
    buffers = reference.generate_medusa_buffers(choices, device="cpu")
    _, tree_candidates = reference.generate_candidates(
        torch.from_numpy(medusa_logits),
        torch.from_numpy(logits),
        buffers["tree_indices"],
        buffers["retrieve_indices"],
        temperature=0,
    )
    top = medusa_top(mx.array(medusa_logits[:, 0, -1]), choices)
    assert [len(t) for t in top] == ranks_needed(choices) == [10, 10, 10, 2]
    tokens, _ = medusa_tree(top, choices)
    assert tree_candidates[0].tolist() == [int(np.argmax(logits[0, -1])), *tokens]


def test_bad_choices_and_tops_are_refused():
    top = [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(BadInput, match="no parent"):
        medusa_tree(top, [(0,), (1, 0)])
    with pytest.raises(BadInput, match="repeat"):
        medusa_tree(top, [(0,), (0,)])
    with pytest.raises(BadInput, match="non-empty"):
        medusa_tree(top, [(0,), ()])
    with pytest.raises(BadInput, match="past the 2 heads"):
        medusa_tree(top, [(0,), (0, 0), (0, 0, 0)])
    with pytest.raises(ValueError, match="repeat one"):
        medusa_tree([[1, 1, 3], [4]], [(0,), (1,)])  # siblings must differ
    with pytest.raises(ValueError, match="the tree uses 3"):
        medusa_tree([[1, 2], [4]], [(0,), (2,)])
    assert medusa_tree(top, []) == ([], ())


# ---------------------------------------------------------------- as a draft, from the CLI


def _tiny_target_and_heads(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny llama's directory and random Medusa heads for it (three, one block each), in
    Medusa's safetensors layout."""
    import json

    from helpers import make_tiny_model

    t = make_tiny_model(tmp_path / "t", seed=0)
    config = json.loads((t / "config.json").read_text())
    d = tmp_path / "heads"
    d.mkdir()
    torch.manual_seed(0)
    heads = reference.medusa_head(config["hidden_size"], config["vocab_size"], 3, 1)
    state = {k: v.contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(d / "medusa_lm_head.safetensors"))
    return t, d


def test_serve_draft_medusa(tmp_path):
    """The official client against `specmlx serve --draft medusa:DIR`: the greedy text of no
    draft, a request that extends an earlier one on its caches, and the heads drafted."""
    from helpers import served_head_equals_no_draft

    t, d = _tiny_target_and_heads(tmp_path)
    served_head_equals_no_draft(tmp_path, t, f"medusa:{d}", 3)


def test_run_draft_medusa_and_its_misfits(tmp_path, specmlx_home):
    """`specmlx run --draft medusa:DIR` over a tiny llama: its trees are verified and the
    greedy text is the target's own; --tree off drafts the chain of each head's best; heads of
    another width are refused in one line."""
    import json

    from typer.testing import CliRunner

    from specmlx.cli import app

    t, d = _tiny_target_and_heads(tmp_path)
    hidden = json.loads((t / "config.json").read_text())["hidden_size"]
    vocab = json.loads((t / "config.json").read_text())["vocab_size"]
    runner = CliRunner()
    args = ["run", "--target", str(t), "-k", "3", "-n", "16", "--temp", "0", "--json", "hello"]
    plain = json.loads(runner.invoke(app, [*args[:3], "--draft", "none", *args[3:]]).stdout)
    for tree in ("6", "off"):
        r = runner.invoke(app, [*args[:3], "--draft", f"medusa:{d}", "--tree", tree, *args[3:]])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["text"] == plain["text"] and out["draft"] == "medusa:heads"
        assert out["stats"]["drafted"] > 0
        assert (out["stats"]["tree_rounds"] > 0) == (tree != "off"), out["stats"]
    wide = tmp_path / "wide"
    wide.mkdir()
    other = reference.medusa_head(hidden + 8, vocab, 2, 1)
    save_file({k: v.contiguous() for k, v in other.state_dict().items()},
              str(wide / "medusa_lm_head.safetensors"))  # fmt: skip
    r = runner.invoke(app, ["run", "--target", str(t), "--draft", f"medusa:{wide}", "x"])
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, (
        r.output
    )  # (nothing loaded)
    assert f"read width {hidden + 8}, the target's hidden size is {hidden}" in r.stderr
