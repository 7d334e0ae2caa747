import torch
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from diloco_p2p.config import ModelConfig
from diloco_p2p.model import ByteTokenizer, build_model, build_tokenizer, count_parameters


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
    assert model.config.hidden_size == 32
    model.save_pretrained(tmp_path)
    ByteTokenizer().save(tmp_path)
    loaded = build_model(ModelConfig(pretrained_path=str(tmp_path)), 259, seed=99)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert isinstance(build_tokenizer(ModelConfig(pretrained_path=str(tmp_path))).encode(b"a").tolist()[0], int)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.num_hidden_layers == 1


def test_the_small_and_35m_presets_have_the_shapes_their_quality_tables_assume():
    from diloco_p2p.config import ModelConfig
    from diloco_p2p.model import ByteTokenizer, build_model

    def non_embedding(preset: str) -> int:
        model = build_model(ModelConfig(preset=preset), ByteTokenizer.vocab_size, 0)
        return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)

    assert non_embedding("small") == 4 * (4 * 256 * 256 + 3 * 256 * 1024 + 2 * 256) + 256
    assert non_embedding("35m") == 6 * (4 * 512 * 512 + 3 * 512 * 2048 + 2 * 512) + 512  # about 25M
