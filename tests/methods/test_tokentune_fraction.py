"""TokenTune ``k`` as a fraction of the real tokens (the official scripts' ``--prefix_length 0.3``)."""
import pytest
import torch

import lowmembp
from lowmembp.methods.tokentune import tokentune_state
from tokentune_refs import batch, build


@pytest.mark.parametrize("name, forced", [("bert", 1), ("llama", 2)])
def test_fraction_selects_forced_plus_share_of_the_rest(name, forced):
    model = lowmembp.apply(build(name), "tokentune", k=0.3, seed=0).train()
    inputs = batch(name, L=23, pad=False)  # every row 23 real tokens
    out = model(**inputs)
    out.loss.backward()
    sel = tokentune_state(model).last
    expected = forced + int(0.3 * (23 - forced))  # BERT 1 + 6 = 7, LLaMA 2 + 6 = 8
    assert sel.positions.shape == (3, expected)
    assert sel.valid.all()
    assert (sel.positions[:, 0] == 0).all()  # the first token, always
    if forced == 2:
        assert (sel.positions[:, -1] == 22).all()  # decoders: the last token too


def test_fraction_counts_from_the_longest_row_and_never_picks_padding():
    model = lowmembp.apply(build("bert"), "tokentune", k=0.5, seed=0).train()
    inputs = batch("bert", L=19)  # row 1 right-padded to 12 real tokens
    model(**inputs).loss.backward()
    sel = tokentune_state(model).last
    assert sel.positions.shape[1] == 1 + int(0.5 * 18)
    mask = inputs["attention_mask"].bool()
    assert torch.equal(sel.valid, mask.gather(1, sel.positions))


def test_integer_valued_float_is_a_count_and_bad_fractions_are_refused():
    model = lowmembp.apply(build("bert"), "tokentune", k=4.0).train()
    assert tokentune_state(model).k == 4 and isinstance(tokentune_state(model).k, int)
    for k in (0.0, 1.5, -0.3):
        with pytest.raises(ValueError, match="fraction 0 < k < 1"):
            lowmembp.apply(build("bert"), "tokentune", k=k)
