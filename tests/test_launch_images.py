"""The container specs (images.toml) and the redaction helpers the launchers report through."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest

from batchbench.adapters.launch.images import ContainerSpec, load_specs, specs_path
from batchbench.adapters.launch.secrets import REDACTED, redact, redact_env, token_env

TOKEN = "hf_SeCrEtToKeN_1234567890"
SPECS = load_specs()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATCHBENCH_IMAGES", raising=False)


# ------------------------------------------------------------- images.toml


def test_images_toml_pins_every_engine() -> None:
    assert set(SPECS) >= {"vllm", "tgi", "trtllm"}
    vllm, tgi, trt = SPECS["vllm"], SPECS["tgi"], SPECS["trtllm"]
    assert vllm.image.startswith("vllm/vllm-openai:v")
    assert tgi.image.startswith("ghcr.io/huggingface/text-generation-inference:")
    assert trt.image.startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    for spec in SPECS.values():
        tag = spec.image.rsplit(":", 1)[1]
        assert tag and tag != "latest"
    # vLLM's image entrypoint is `vllm serve`, TGI's runs text-generation-launcher:
    # only arguments follow. TensorRT-LLM's release image needs the command.
    assert (vllm.program, tgi.program, trt.program) == ((), (), ("trtllm-serve",))
    assert (vllm.port, tgi.port, trt.port) == (8000, 80, 8000)
    assert trt.ipc_mode == "host" and dict(trt.ulimits) == {"memlock": -1, "stack": 67108864}
    assert vllm.shm_size == "16g" and tgi.shm_size == "1g" and vllm.ipc_mode is None
    assert tgi.hf_home == "/data" and vllm.hf_home == "/root/.cache/huggingface"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('image = "x/y:1"\nport = 1\nbogus = 1', "unknown keys"),
        ('image = "x/y"\nport = 1', "explicit tag"),
        ('image = "x/y:latest"\nport = 1', "not 'latest'"),
        ('image = "x/y:1"\ncpu_image = "x/y-cpu"\nport = 1', "cpu_image 'x/y-cpu' must carry an explicit tag"),
        ('image = "x/y:1"', "missing 'port'"),
        ('image = "x/y:1"\nport = 0', "port must be"),
        ('image = "x/y:1"\nport = 1\nprogram = "a b"', "program must be"),
    ],
)
def test_load_specs_rejects_bad_tables(tmp_path: Path, table: str, message: str) -> None:
    path = tmp_path / "images.toml"
    path.write_text(f"[eng]\n{table}\n")
    with pytest.raises(ValueError, match=message):
        load_specs(path)


def test_load_specs_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "images.toml"
    path.write_text('[eng]\nimage = "registry.example:5000/x/y:1.0"\nport = 9000\n')
    monkeypatch.setenv("BATCHBENCH_IMAGES", str(path))
    assert load_specs() == {"eng": ContainerSpec(engine="eng", image="registry.example:5000/x/y:1.0", port=9000)}



def test_the_default_specs_are_the_package_data() -> None:
    packaged = files("batchbench.adapters").joinpath("images.toml")
    assert specs_path() == Path(str(packaged)) and specs_path().is_file()
    assert load_specs(specs_path()) == SPECS


def test_spec_descriptions_never_show_a_secret(tmp_path: Path) -> None:
    path = tmp_path / "images.toml"
    path.write_text(f'[eng]\nimage = "x/y:1"\nport = 1\nenv = {{ HF_TOKEN = "{TOKEN}", MODE = "fast" }}\n')
    (spec,) = load_specs(path).values()
    assert spec.env["HF_TOKEN"] == TOKEN  # the server gets it
    assert spec.to_dict()["env"] == {"HF_TOKEN": REDACTED, "MODE": "fast"}


# ---------------------------------------------------------------- secrets


def test_redact_env_hides_secret_looking_names() -> None:
    env = {"HF_TOKEN": TOKEN, "AWS_SECRET_ACCESS_KEY": "k", "OPENAI_API_KEY": "k", "DB_PASSWORD": "p",
           "HF_HOME": "/data", "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert redact_env(env) == {"HF_TOKEN": REDACTED, "AWS_SECRET_ACCESS_KEY": REDACTED, "OPENAI_API_KEY": REDACTED,
                               "DB_PASSWORD": REDACTED, "HF_HOME": "/data", "VLLM_CPU_KVCACHE_SPACE": "4"}


def test_redact_replaces_every_secret_longest_first() -> None:
    text = f"token {TOKEN}, prefix {TOKEN[:8]}, again {TOKEN}"
    assert redact(text, [TOKEN[:8], TOKEN]) == f"token {REDACTED}, prefix {REDACTED}, again {REDACTED}"
    # Too short to be a secret worth hiding (it would mangle ordinary words), or empty.
    assert redact("a bc abc", ["", "bc", "abc"]) == "a bc abc"


def test_token_env_sets_both_names() -> None:
    assert token_env({}) == {}
    assert token_env({"HF_TOKEN": ""}) == {}
    assert token_env({"HUGGING_FACE_HUB_TOKEN": TOKEN}) == {"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN}
    assert token_env({"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": "other"})["HUGGING_FACE_HUB_TOKEN"] == TOKEN
