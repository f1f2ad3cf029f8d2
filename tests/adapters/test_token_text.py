from adapters.token_text import TokenText


def test_bytes_of_split_characters_join_back(tokenizer):
    text = "naïve café 🙂 日本"
    ids = tokenizer.encode(text)
    tt = TokenText(tokenizer)
    joined = b"".join(bytes(tt(i)[1]) for i in ids)
    assert joined.decode("utf-8") == text


def test_plain_tokens_and_special_tokens(tokenizer):
    tt = TokenText(tokenizer)
    ids = tokenizer.encode(" hello world")
    assert "".join(tt.text(i) for i in ids) == " hello world"
    eos = tokenizer.eos_token_id
    assert tt.text(eos) == tokenizer.eos_token
