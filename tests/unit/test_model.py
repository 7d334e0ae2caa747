import pytest
import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaForCausalLM

from diloco_p2p.config import ModelConfig
from diloco_p2p.errors import UserError
from diloco_p2p.model.build import (
    ByteTokenizer,
    build_model,
    build_tokenizer,
    count_parameters,
    llama_config,
    llama_shape,
    save_pretrained,
)


def test_byte_tokenizer_matches_byt5_layout():
    text = "déjà vu: x = 1\n"
    ours = ByteTokenizer().encode(text.encode()).tolist()
    theirs = ByT5Tokenizer(extra_ids=0)(text, add_special_tokens=False).input_ids
    assert ours == theirs


def test_same_seed_same_parameters_and_tiny_is_small():
    a = build_model(ModelConfig(), 259, seed=3)
    b = build_model(ModelConfig(), 259, seed=3)
    c = build_model(ModelConfig(), 259, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    assert 100_000 < count_parameters(a) < 1_000_000


def test_field_overrides_and_local_pretrained_path(tmp_path):
    model = build_model(ModelConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                                    intermediate_size=64, num_hidden_layers=1), 259, seed=0)
    assert model.shape.hidden_size == 32
    save_pretrained(model, tmp_path)
    ByteTokenizer().save(tmp_path)
    loaded = build_model(ModelConfig(pretrained_path=str(tmp_path)), 259, seed=99)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert isinstance(build_tokenizer(ModelConfig(pretrained_path=str(tmp_path))).encode(b"a").tolist()[0], int)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 1


def test_the_small_and_35m_presets_have_the_shapes_their_quality_tables_assume():
    from diloco_p2p.config import ModelConfig
    from diloco_p2p.model.build import ByteTokenizer, build_model

    def non_embedding(preset: str) -> int:
        model = build_model(ModelConfig(preset=preset), ByteTokenizer.vocab_size, 0)
        return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)

    assert non_embedding("small") == 4 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256
    assert non_embedding("35m") == 6 * (4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512) + 512  # about 25M


GQA = ModelConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=2,
                  extra={"rope_theta": 500000.0, "rms_norm_eps": 1e-5})


@pytest.mark.parametrize("cfg", [ModelConfig(), GQA, ModelConfig(extra={"tie_word_embeddings": True})],
                         ids=["tiny", "grouped-query", "tied"])
def test_the_llama_is_transformers_llama_bit_for_bit(cfg):
    """Same seed, same θ₀ as transformers' LlamaForCausalLM of the same config; same logits and the
    same gradients on a batch, bit for bit; the same names in the same order (checkpoints and exports)."""
    ours = build_model(cfg, 259, seed=5)
    torch.manual_seed(5)
    theirs = LlamaForCausalLM(llama_config(llama_shape(cfg, 259)))
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))
    ids = torch.randint(0, 259, (3, 40), generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (ours, theirs):
        logits = model(input_ids=ids).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append([p.grad for p in model.parameters()])
        grads[-1].insert(0, logits.detach())
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_model_extra_fields_the_llama_does_not_read_are_one_clear_error():
    with pytest.raises(UserError, match=r"model.extra: attention_bias not supported .* model.pretrained_path"):
        build_model(ModelConfig(extra={"attention_bias": True}), 259, seed=0)
    with pytest.raises(UserError, match=r"num_attention_heads must be a multiple of model.num_key_value_heads"):
        build_model(ModelConfig(num_key_value_heads=3), 259, seed=0)
    with pytest.raises(UserError, match=r"model.extra.rope_theta: 'big' is not a float"):
        build_model(ModelConfig(extra={"rope_theta": "big"}), 259, seed=0)
