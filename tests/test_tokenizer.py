import string

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from asyncfp8.models.tokenizer import EOS_TOKEN, PAD_TOKEN, build_byte_tokenizer

ASCII = string.printable  # letters, digits, punctuation, whitespace


@given(st.text(alphabet=ASCII, max_size=80))
@settings(max_examples=200, deadline=None)
def test_ascii_round_trips_one_token_per_character(text):
    # The special tokens' own text maps to them, as in every HF tokenizer (hypothesis
    # finds "<|pad|>": it tries the string constants of the code under test).
    assume(PAD_TOKEN not in text and EOS_TOKEN not in text)
    tokenizer = build_byte_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())  # a byte's id is its value: independent reference
    assert tokenizer.decode(ids) == text


def test_autotokenizer_loads_back_the_same_tokenizer(tmp_path):
    # A Qwen2 model directory makes AutoTokenizer pick Qwen2Tokenizer: what we save
    # must survive that, spaces and newlines included.
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=320).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Q: 12*11\nA: 132 and some words, $3.50!"
    assert (
        loaded(text)["input_ids"]
        == build_byte_tokenizer()(text)["input_ids"]
        == list(text.encode())
    )
    assert loaded.eos_token == EOS_TOKEN and loaded.eos_token_id == 256
    assert loaded.pad_token == PAD_TOKEN and loaded.pad_token_id == 257
    assert loaded.decode([*list(b"42"), 256], skip_special_tokens=True) == "42"
