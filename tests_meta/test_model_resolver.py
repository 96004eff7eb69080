"""Meta tests of how a --model value becomes a config: built-in recipes and shipped families are
both config dirs (fixtures/models/recipes/<name>/, fixtures/models/families/<name>/), read by one
reader, and the recipes give exactly the configs, and the proxies exactly the bytes, they gave
when they were a Python dict."""
from __future__ import annotations

import hashlib
import json

import pytest

from fixtures.models import proxies as P

# Recorded from the recipes as a Python dict in fixtures/models/proxies.py, before they became
# config dirs: sha256 of json.dumps(recipe, sort_keys=True) (so an int that became a float, or a
# key's value, changes it), and of the tiny proxy's config.json and weights at seed 0. mamba2's
# weights were recorded again when A_log and dt_bias moved to float64 log / exp (rounded once to
# float32), so that no proxy's bytes depend on the CPU's instruction set (MKL's float32 vector
# log / exp round differently under AVX2 and AVX-512); its recipe and config are the dict's.
BEFORE = {
    "llama": ("768ba70c25aebd2b0d578bb10c3267d78f2d83c81c40161e7ae6cb4c63be18fc",
              "f9b3ef3fcb7003a6e8fd7eaeb847685531bef30d3d9c33f7052bc5840e1240fa",
              "e21f7de920949939f6cfe78aff8f6f370c19b8c1bee32d03fe1240fe227e3436"),
    "qwen3": ("dec38b5c3354f4541f831edfe4b7fc9369c68f09fc143e64975a191b65c28405",
              "3022dae1e22439ff51fab3127a27d5829b233d310a1046945f60eb4d52844016",
              "cc00aefad88a4271388ddc8cc6510499586efee2f77de9ba710766326c4532af"),
    "qwen3_moe": ("e188252c54fa9868f403744c87adf8b7d3b0d5cdefcfce1801fca7afb6f0bdc7",
                  "83c63436498dadb118c4c6147cbbb28eb968adb7939757749e42501abba5ebdd",
                  "457b85bab42e932a4f3f42f2685f7ead83de722fa24dabdf6eb3c42ac2fa2238"),
    "mamba2": ("2edd9c22d711ab243d2b2e96a4503eddb01957d2c420ac34f899c123819b2234",
               "6496dd12190a81748253d3707051f3111d87f2a22096391032163941fc5c9b81",
               "c5f2a91a4c0bf4e3a41fb20171a4f40689315aa641abccf411b3fa4f62c18153"),
    "nemotron_h": ("8056234a45a420e255e4e39b7e5e22f27ffc0021d0f441cf954e60843e3adf76",
                   "3d1a8bf34c8c0ada8931cc4c3788c7668a33a9e4c61c74aa90fd9cd3f4b6f338",
                   "0c18f4ab414877bd578e0417d6cfdbe554ca0929e0e1abdfb82071bb5fb29c06"),
}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_recipes_and_their_default_order():
    """The default run's models and column order are the five recipes, as before."""
    assert list(P.RECIPES) == list(BEFORE)
    assert [d.name for d in P.recipe_dirs()] == list(BEFORE)


@pytest.mark.parametrize("name", list(BEFORE))
def test_a_recipe_dir_gives_the_config_the_dict_gave(name):
    recipe_sha, _, _ = BEFORE[name]
    assert _sha256(json.dumps(P.RECIPES[name], sort_keys=True).encode()) == recipe_sha
    on_disk = json.loads((P.RECIPES_DIR / name / "config.json").read_text())
    assert on_disk == P.RECIPES[name]
    assert P.config_dir(name) == P.RECIPES_DIR / name
    assert P.source_config(name).to_dict() == P.make_config(dict(P.RECIPES[name])).to_dict()


@pytest.mark.parametrize("name", list(BEFORE))
def test_a_recipe_builds_the_same_tiny_proxy_bytes(name, tmp_path):
    _, config_sha, weights_sha = BEFORE[name]
    spec = P.build_proxy(name, "tiny", tmp_path / name)
    assert _sha256((spec.path / "config.json").read_bytes()) == config_sha
    assert spec.weights_sha256 == weights_sha
    assert json.loads((spec.path / "proxy.json").read_text())["model"] == name   # the name, not a path


def test_each_recipe_says_what_it_stands_for():
    for d in P.recipe_dirs():
        meta = json.loads((d / "recipe.json").read_text())
        assert isinstance(meta.get("real_model"), str) and meta["real_model"], d
        assert isinstance(meta.get("default_order"), int), d


def test_one_resolver_for_recipes_families_and_paths(tmp_path, monkeypatch):
    """A recipe's name stays the name; a family's name is its shipped dir; a path is itself, and a
    path of a family's name in the working dir wins over the family."""
    assert P.resolve_model("llama") == "llama"
    assert P.resolve_model("zamba2") == str(P.FAMILIES_DIR / "zamba2")
    assert P.resolve_model(str(tmp_path)) == str(tmp_path)
    assert P.resolve_model("no_such_model") == "no_such_model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "zamba2").mkdir()
    assert P.resolve_model("zamba2") == "zamba2"
    assert {d.name for d in P.family_dirs()}.isdisjoint(P.RECIPES)


def test_a_new_recipe_is_a_config_dir(tmp_path, monkeypatch):
    """Adding a recipe is adding a directory: config.json plus recipe.json's default_order."""
    for d in P.recipe_dirs():
        (tmp_path / d.name).mkdir()
        for f in ("config.json", "recipe.json"):
            (tmp_path / d.name / f).write_bytes((d / f).read_bytes())
    (tmp_path / "tinyllama").mkdir()
    (tmp_path / "tinyllama" / "config.json").write_text(json.dumps(dict(P.RECIPES["llama"], hidden_size=2048)))
    (tmp_path / "tinyllama" / "recipe.json").write_text(json.dumps({"real_model": "x", "default_order": 0}))
    monkeypatch.setattr(P, "RECIPES_DIR", tmp_path)
    recipes = P._read_recipes()
    assert list(recipes) == ["tinyllama", *BEFORE]
    assert recipes["tinyllama"]["hidden_size"] == 2048
