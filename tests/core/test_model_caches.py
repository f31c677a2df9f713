"""``transformers`` caches among ``f``'s arguments (NOTE [model caches]).

Session 63's hunt: a ``DynamicCache`` passed as ``past_key_values`` grew with every one of
torchgram's evaluations: every backend's Gramian 0.02-0.05 off on this LLaMA (up to 0.46 on
GPT-2), and the caller's cache left with 29 positions instead of a plain call's 9.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import torchgram as tg
from reference import dense_gramian

DOUBLE = torch.float64
BACKENDS = ["auto", "structured", "graph", "jacobian", "ntvp"]
_CACHE = ("cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters
          else "past_key_values")  # (the name since transformers 5.25)


def _llama() -> tuple[Any, dict[str, Tensor], Tensor, Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config).to(DOUBLE).eval()
    fn, params = tg.functionalize(model)
    return fn, params, torch.randint(0, 20, (3, 4)), torch.randint(0, 20, (3, 3))


def _losses(fn: Any, p: dict[str, Tensor], ids: Tensor, cache: Any) -> Tensor:
    logits = fn(p, ids, use_cache=True, **{_CACHE: cache}).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _prefix_cache(fn: Any, params: dict[str, Tensor], prefix: Tensor) -> DynamicCache:
    with torch.no_grad():
        return fn(params, prefix, use_cache=True).past_key_values


@pytest.mark.parametrize("how", ["keyword", "positional", "in_a_dict"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dynamic_cache_argument_is_refused_and_left_alone(backend: str, how: str) -> None:
    fn, params, prefix, ids = _llama()
    cache = _prefix_cache(fn, params, prefix)
    def f(p: dict[str, Tensor], ids: Tensor, *given: Any, **keywords: Any) -> Tensor:
        held = (given or (keywords["extra"],))[0]
        return _losses(fn, p, ids, held["c"] if isinstance(held, dict) else held)

    call = tg.gramian(f, backend=backend, batch_dim=0)
    args: tuple[Any, ...] = (params, ids)
    kwargs: dict[str, Any] = {}
    if how == "keyword":
        kwargs = {"extra": {"c": cache}}
    elif how == "positional":
        args = (params, ids, cache)
    else:
        args = (params, ids, {"c": cache})
    with pytest.raises(ValueError, match=r"^torchgram.gramian: expected arguments that f's "
                       r"evaluations leave as they found them, but got a transformers "
                       r"DynamicCache in (argument 2|keyword 'extra').*copy.deepcopy"):
        call(*args, **kwargs)
    assert cache.get_seq_length() == 4


@pytest.mark.parametrize("backend", ["auto", "structured", "graph"])
def test_a_cache_f_copies_for_itself_is_right(backend: str) -> None:
    fn, params, prefix, ids = _llama()
    cache = _prefix_cache(fn, params, prefix)

    def f(p: dict[str, Tensor], ids: Tensor) -> Tensor:
        return _losses(fn, p, ids, copy.deepcopy(cache))

    wanted = dense_gramian(f, (params, ids)).gramian
    got = tg.gramian(f, backend=backend, batch_dim=0)(params, ids)
    torch.testing.assert_close(got, wanted, rtol=1e-10, atol=1e-12)
    assert cache.get_seq_length() == 4


def test_a_static_cache_is_refused_too() -> None:
    # Empty, it makes its tensors at its first update, for the probe's single sample: the next
    # evaluation met torch's raw index_copy_ error.
    fn, params, _, ids = _llama()
    config = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    cache = StaticCache(config=config, max_cache_len=8)
    with pytest.raises(ValueError, match="a transformers StaticCache in argument 2"):
        tg.gramian(lambda p, ids, cache: _losses(fn, p, ids, cache), batch_dim=0)(
            params, ids, cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_captured_cache_that_f_updates_is_refused_after_the_call(backend: str) -> None:
    fn, params, prefix, ids = _llama()
    cache = _prefix_cache(fn, params, prefix)
    with pytest.raises(ValueError, match=r"a transformers DynamicCache that f captured and "
                       r"whose forward updated it.*copy.deepcopy"):
        tg.gramian(lambda p, ids: _losses(fn, p, ids, cache), backend=backend,
                   batch_dim=0)(params, ids)


def test_a_cache_held_by_an_argument_is_refused_before_any_work() -> None:
    # Session 63's review: a cache inside a dataclass or a namespace was missed (0.42 off),
    # later refused only after the call, the cache grown.
    import types

    fn, params, prefix, ids = _llama()
    cache = _prefix_cache(fn, params, prefix)
    held = types.SimpleNamespace(cache=cache)
    with pytest.raises(ValueError, match=r"a transformers DynamicCache in argument 2"):
        tg.gramian(lambda p, ids, held: _losses(fn, p, ids, held.cache), batch_dim=0)(
            params, ids, held)
    assert cache.get_seq_length() == 4


def test_a_captured_cache_made_in_inference_mode_that_f_copies() -> None:
    # The second review: reading the version of its inference tensors raised torch's raw
    # "Inference tensors do not track version counter".
    fn, params, prefix, ids = _llama()
    with torch.inference_mode():
        cache = fn(params, prefix, use_cache=True).past_key_values

    def f(p: dict[str, Tensor], ids: Tensor) -> Tensor:
        return _losses(fn, p, ids, copy.deepcopy(cache))

    assert tg.gramian(f, batch_dim=0)(params, ids).shape == (3, 3)
