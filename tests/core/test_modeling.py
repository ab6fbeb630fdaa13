"""PolicyBERT model: no-match equivalence with BertModel, the gate init, gradients, tying and heads."""

from __future__ import annotations

import pytest
import torch
from transformers import BertModel

from chatchat_policybert.model.configuration_policybert import CONFIG_ERRORS, PolicyBertConfig
from chatchat_policybert.model.lexicon import Lexicon
from chatchat_policybert.model.modeling_policybert import (
    PolicyBertForPreTraining,
    PolicyBertForSequenceClassification,
    PolicyBertModel,
    merge_repeated_words,
)
from chatchat_policybert.model.tokenization_policybert import PolicyBertTokenizer
from tests.support.tiny_models import tiny_config

FUSIONS = ("none", "gate", "attn")
TOL = 1e-5
# A lexicon none of whose words occur in the fixture text.
NO_HIT_LEXICON = Lexicon(["甲乙丙丁戊", "子丑寅卯辰", "zzqqxx"], [1, 1, 1])


def word_inputs(enc) -> dict:
    return {k: enc[k] for k in ("word_ids", "word_attention_mask", "word_matching_matrix")}


def char_inputs(enc) -> dict:
    return {k: enc[k] for k in ("input_ids", "token_type_ids", "attention_mask")}


def max_diff_on_real_tokens(a: torch.Tensor, b: torch.Tensor, attention_mask: torch.Tensor) -> float:
    mask = attention_mask.bool()
    return (a[mask] - b[mask]).abs().max().item()


@pytest.fixture(scope="module")
def padded_texts(policy_sentences) -> list[str]:
    chosen = sorted(policy_sentences[10:40], key=len)
    return [chosen[-1], chosen[0], chosen[len(chosen) // 2]]


def load_pair(path):
    """PolicyBERT and a plain transformers BertModel reading the same character weights."""
    policy = PolicyBertModel.from_pretrained(path).eval()
    bert = BertModel.from_pretrained(path).eval()
    policy_state = policy.state_dict()
    bert_state = bert.state_dict()
    for key, value in bert_state.items():
        assert torch.equal(value, policy_state[key]), f"{key} differs: the baseline must share char weights"
    assert any(k.startswith("word_encoder.") for k in policy_state)
    return policy, bert, PolicyBertTokenizer.from_pretrained(path)


@pytest.fixture(scope="module", params=FUSIONS)
def fusion_models(request, tiny_model_dir):
    return request.param, *load_pair(tiny_model_dir(request.param, perturb=True))


# --------------------------------------------------------------------------- 1. no-match equivalence


@pytest.mark.parametrize("case", ["zero_matrix", "zero_word_mask", "no_word_ids"])
def test_no_match_equals_plain_bert(fusion_models, padded_texts, case):
    fusion, policy, bert, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    assert (enc["attention_mask"] == 0).any(), "the batch must contain padding"
    assert enc["word_attention_mask"].sum() > 5, "the texts do contain lexicon words"
    words = word_inputs(enc)
    if case == "zero_matrix":
        words["word_matching_matrix"] = torch.zeros_like(words["word_matching_matrix"])
    elif case == "zero_word_mask":
        words["word_attention_mask"] = torch.zeros_like(words["word_attention_mask"])
    else:
        words = {}
    with torch.no_grad():
        out = policy(**char_inputs(enc), **words)
        ref = bert(**char_inputs(enc))
    assert max_diff_on_real_tokens(out.last_hidden_state, ref.last_hidden_state, enc["attention_mask"]) <= TOL
    assert (out.pooler_output - ref.pooler_output).abs().max().item() <= TOL


def test_matched_words_do_change_the_output(fusion_models, padded_texts):
    """Control for the equivalence tests: with words the fused model is NOT plain BERT."""
    fusion, policy, bert, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    with torch.no_grad():
        out = policy(**char_inputs(enc), **word_inputs(enc)).last_hidden_state
        ref = bert(**char_inputs(enc)).last_hidden_state
    assert max_diff_on_real_tokens(out, ref, enc["attention_mask"]) > 1e-3


@pytest.mark.parametrize("fusion", FUSIONS)
def test_lexicon_without_hits_equals_plain_bert(tiny_model_dir, padded_texts, fusion):
    policy, bert, tokenizer = load_pair(tiny_model_dir(fusion, lexicon=NO_HIT_LEXICON, perturb=True))
    assert policy.config.word_vocab_size == len(NO_HIT_LEXICON)
    enc = tokenizer(padded_texts)
    assert enc["word_attention_mask"].sum() == 0 and enc["word_matching_matrix"].sum() == 0
    with torch.no_grad():
        out = policy(**char_inputs(enc), **word_inputs(enc))
        ref = bert(**char_inputs(enc))
    assert not torch.isnan(out.last_hidden_state).any()
    assert max_diff_on_real_tokens(out.last_hidden_state, ref.last_hidden_state, enc["attention_mask"]) <= TOL
    assert (out.pooler_output - ref.pooler_output).abs().max().item() <= TOL


def test_example_without_words_is_plain_bert_inside_a_mixed_batch(fusion_models, padded_texts, reference_lexicon):
    """Per example: a text with no word in a batch next to texts with words still equals BERT."""
    fusion, policy, bert, tokenizer = fusion_models
    wordless = "我们也要这样做。"
    assert reference_lexicon.match(wordless) == []
    texts = [padded_texts[0], wordless, padded_texts[2]]
    enc = tokenizer(texts)
    assert enc["word_attention_mask"][1].sum() == 0 and enc["word_attention_mask"][0].sum() > 0
    with torch.no_grad():
        out = policy(**char_inputs(enc), **word_inputs(enc)).last_hidden_state
        ref = bert(**char_inputs(enc)).last_hidden_state
    real = enc["attention_mask"][1].bool()
    assert (out[1][real] - ref[1][real]).abs().max().item() <= TOL


@pytest.mark.parametrize("fusion", FUSIONS)
def test_all_layers_fused_no_match_equals_bert(tiny_model_dir, padded_texts, fusion):
    """num_word_layers == num_hidden_layers (no late fusion) and late_fusion='none' variants."""
    for overrides in ({"num_word_layers": 2}, {"late_fusion": "none"}):
        policy, bert, tokenizer = load_pair(tiny_model_dir(fusion, perturb=True, **overrides))
        enc = tokenizer(padded_texts)
        words = word_inputs(enc)
        words["word_matching_matrix"] = torch.zeros_like(words["word_matching_matrix"])
        with torch.no_grad():
            out = policy(**char_inputs(enc), **words).last_hidden_state
            ref = bert(**char_inputs(enc)).last_hidden_state
        assert max_diff_on_real_tokens(out, ref, enc["attention_mask"]) <= TOL, overrides


def test_word_vocab_size_zero_is_plain_bert(tiny_model_dir, padded_texts):
    path = tiny_model_dir(None)
    bert = BertModel.from_pretrained(path).eval()
    config = PolicyBertConfig(**{**bert.config.to_dict(), "word_vocab_size": 0})
    policy = PolicyBertModel(config).eval()
    missing, unexpected = policy.load_state_dict(bert.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("position_ids") and "token_type_ids" not in k]
    tokenizer = PolicyBertTokenizer.from_pretrained(path)
    enc = tokenizer(padded_texts)
    with torch.no_grad():
        a = policy(**enc).last_hidden_state
        b = bert(**enc).last_hidden_state
    assert max_diff_on_real_tokens(a, b, enc["attention_mask"]) <= TOL


def test_word_ids_without_matrix_is_an_error(fusion_models, padded_texts):
    fusion, policy, _, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    with pytest.raises(ValueError, match="word_matching_matrix"):
        policy(**char_inputs(enc), word_ids=enc["word_ids"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"fusion_type": "concat"}, "fusion_type' expected one of"),
        ({"late_fusion": "mean"}, "late_fusion' expected one of"),
        (
            {"word_vocab_size": 10, "num_hidden_layers": 2, "num_word_layers": 3},
            "num_word_layers must be in 1..num_hidden_layers",
        ),
        ({"max_words": 0}, "max_words must be an integer >= 1, got 0"),
        ({"max_words": True}, "max_words' expected int, got bool"),
        ({"word_vocab_size": "2663"}, "word_vocab_size' expected int, got str"),
        ({"gate_bias_init": "5"}, "gate_bias_init"),
    ],
)
def test_config_validation(values, message):
    """Every field is typed and checked on construction, as ``BertConfig``'s are."""
    with pytest.raises(CONFIG_ERRORS, match=message):
        PolicyBertConfig(**values)


def test_repeated_words_run_once_with_the_same_output(fusion_models, padded_texts):
    """Inference merges the occurrences of a word (count as log-bias, M summed); training runs each.

    With every dropout at zero the two paths are the same function, so train mode is the
    occurrence-by-occurrence reference for eval mode's merged one.
    """
    fusion, policy, _, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    valid = enc["word_ids"][enc["word_attention_mask"].bool()]
    assert len(valid.unique()) < len(valid), "the texts repeat lexicon words"
    dropouts = [m for m in policy.modules() if isinstance(m, torch.nn.Dropout)]
    saved = [m.p for m in dropouts]
    captured = []
    hook = policy.word_encoder[0].register_forward_hook(lambda m, args, out: captured.append(args[0].shape[1]))
    try:
        for m in dropouts:
            m.p = 0.0
        with torch.no_grad():
            merged = policy(**enc).last_hidden_state
            policy.train()
            occurrences = policy(**enc).last_hidden_state
    finally:
        policy.eval()
        hook.remove()
        for m, p in zip(dropouts, saved):
            m.p = p
    assert captured[0] < captured[1] == enc["word_ids"].shape[1], "eval mode runs fewer words"
    assert max_diff_on_real_tokens(merged, occurrences, enc["attention_mask"]) <= TOL


def test_merge_repeated_words_keeps_m_w_and_counts():
    """Overlapping occurrences of one word (``A A`` inside ``A A A``) must add up, not collapse."""
    word_ids = torch.tensor([[7, 9, 7, 7, 0], [0, 0, 0, 0, 0]])
    valid = word_ids != 0
    matching = torch.zeros(2, 6, 5)
    for q, (first, last) in enumerate([(0, 2), (2, 4), (1, 3), (4, 6)]):
        matching[0, first:last, q] = 1.0
    states = torch.randn(10, 3)
    ids, counts, merged = merge_repeated_words(word_ids, valid, matching)
    assert ids.tolist() == [[7, 9], [0, 0]] and counts.tolist() == [[3.0, 1.0], [0.0, 0.0]]
    torch.testing.assert_close(torch.bmm(merged, states[ids]), torch.bmm(matching, states[word_ids] * valid[..., None]))
    assert merged[0, 1, 0] == 2.0, "character 1 lies in two occurrences of word 7"
    ids, counts, merged = merge_repeated_words(word_ids[1:], valid[1:], matching[1:])
    assert ids.shape == counts.shape == (1, 1) and merged.shape == (1, 6, 1), "a wordless batch keeps one padding word"


def naive_fusion(fusion, chars: torch.Tensor, words: torch.Tensor, matching: torch.Tensor) -> torch.Tensor:
    """The fusion formulas as written, on ``M W`` (character length), with transformers' own cross-attention."""
    words_on_chars = torch.bmm(matching, words)
    if fusion.fusion_type == "none":
        return chars + words_on_chars
    if fusion.fusion_type == "gate":
        return chars + torch.sigmoid(fusion.gate(torch.cat([chars, words_on_chars], dim=-1))) * words_on_chars
    covered = matching.any(dim=-1)
    has_words = covered.any(dim=-1)
    keys = (covered | ~has_words[:, None])[:, None, None, :]
    fused, _ = fusion.attention(chars, encoder_hidden_states=words_on_chars, encoder_attention_mask=keys)
    return torch.where(has_words[:, None, None], fused, chars)


def test_fusions_compute_their_formulas(fusion_models, padded_texts):
    """Projections run on words before ``M`` maps them (the fast order); values must be the formula's."""
    fusion_type, policy, _, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    captured = []
    hooks = [f.register_forward_hook(lambda m, args, out: captured.append((m, args, out))) for f in policy.fusions]
    try:
        with torch.no_grad():
            policy(**enc)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured) == len(policy.fusions)
    for fusion, (chars, words, matching, _), output in captured:
        assert matching.flatten(1).any(dim=-1).sum() >= 2, "most texts have matched words"
        # attn keys are the distinct coverage rows of M: overlapping words must make rows of their own.
        assert (matching.sum(dim=-1) >= 2).any(), "some character lies inside two words"
        with torch.no_grad():
            expected = naive_fusion(fusion, chars, words, matching)
        mask = enc["attention_mask"].bool()
        assert (output[mask] - expected[mask]).abs().max().item() < TOL
        assert (output[mask] - chars[mask]).abs().max().item() > 1e-3, f"{fusion_type} changes covered characters"


# --------------------------------------------------------------------------- 2. the gate


def policy_config(char_tokenizer, **overrides) -> PolicyBertConfig:
    """The shared tiny BERT shape (``testing.tiny_config``) with a gated word stream of 2 layers."""
    return PolicyBertConfig(
        **tiny_config(
            len(char_tokenizer), **{"word_vocab_size": 3000, "num_word_layers": 2, "fusion_type": "gate", **overrides}
        )
    )


@pytest.mark.parametrize(
    "model_class", [PolicyBertModel, PolicyBertForPreTraining, PolicyBertForSequenceClassification]
)
def test_fresh_gate_bias_is_gate_bias_init(char_tokenizer, reference_lexicon, model_class):
    for bias_init in (5.0, 2.5):
        torch.manual_seed(0)
        model = model_class(
            policy_config(char_tokenizer, word_vocab_size=len(reference_lexicon), gate_bias_init=bias_init)
        )
        base = model if isinstance(model, PolicyBertModel) else model.bert
        assert len(base.fusions) == 2
        for fusion in base.fusions:
            assert torch.all(fusion.gate.bias == bias_init)
            assert fusion.gate.weight.abs().max() > 0, "the weight itself is initialised normally"


def test_fresh_gate_activations_near_sigmoid5(char_tokenizer, reference_lexicon, policy_sentences):
    torch.manual_seed(0)
    model = PolicyBertModel(policy_config(char_tokenizer, word_vocab_size=len(reference_lexicon))).eval()
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    enc = tokenizer(policy_sentences[:6])
    captured = []
    hooks = [
        f.register_forward_hook(lambda module, args, output: captured.append((module, args[:3]))) for f in model.fusions
    ]
    try:
        with torch.no_grad():
            model(**enc)
    finally:
        for h in hooks:
            h.remove()
    assert len(captured) == 2
    covered = (enc["word_matching_matrix"].sum(-1) > 0) & enc["attention_mask"].bool()
    assert covered.sum() > 20
    expected = torch.sigmoid(torch.tensor(5.0)).item()
    for fusion, (chars, words, matching) in captured:
        words_on_chars = torch.bmm(matching, words)
        # The gate really sees (non-zero) word states, and the factored form is the formula.
        assert words_on_chars[covered].abs().sum() > 0
        with torch.no_grad():
            gates = fusion.gate_values(chars, words, matching)
            naive = torch.sigmoid(fusion.gate(torch.cat([chars, words_on_chars], dim=-1)))
        torch.testing.assert_close(gates, naive, atol=1e-6, rtol=1e-5)
        values = gates[covered]
        assert values.mean().item() > 0.95
        assert abs(values.mean().item() - expected) < 0.01
        assert values.min().item() > 0.9


def test_trained_gate_bias_survives_save_and_reload(char_tokenizer, reference_lexicon, policy_sentences, tmp_path):
    from chatchat_policybert.model.loading import load_policybert, save_model_dir

    torch.manual_seed(0)
    config = policy_config(char_tokenizer, word_vocab_size=len(reference_lexicon), num_word_layers=1)
    model = PolicyBertModel(config)
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    enc = tokenizer(policy_sentences[:4])
    optimizer = torch.optim.SGD(model.parameters(), lr=50.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(**enc).last_hidden_state.pow(2).mean().backward()
        optimizer.step()
    trained = model.fusions[0].gate.bias.detach().clone()
    assert not torch.all(trained == 5.0), "training moved the bias"

    model.save_pretrained(tmp_path / "hf")
    reloaded = PolicyBertModel.from_pretrained(tmp_path / "hf")
    assert torch.equal(reloaded.fusions[0].gate.bias, trained)

    save_model_dir(model, tokenizer, tmp_path / "dir")
    loaded, _ = load_policybert(tmp_path / "dir")
    assert torch.equal(loaded.fusions[0].gate.bias, trained)


# --------------------------------------------------------------------------- 3. gradients and tying


def pretraining_batch(tokenizer: PolicyBertTokenizer, sentences: list[str]) -> dict:
    a = sentences[0:8:2]
    b = sentences[1:8:2]
    enc = tokenizer(a, b)
    labels = torch.full_like(enc["input_ids"], -100)
    special = torch.isin(enc["input_ids"], torch.tensor(tokenizer.tokenizer.all_special_ids))
    candidates = (~special & enc["attention_mask"].bool()).nonzero()
    chosen = candidates[::6]
    labels[chosen[:, 0], chosen[:, 1]] = enc["input_ids"][chosen[:, 0], chosen[:, 1]]
    enc["input_ids"][chosen[:, 0], chosen[:, 1]] = tokenizer.tokenizer.mask_token_id
    enc["labels"] = labels
    enc["next_sentence_label"] = torch.tensor([0, 1, 0, 1])
    return enc


@pytest.mark.parametrize("fusion", FUSIONS)
def test_gradient_reaches_word_stream_and_fusion(char_tokenizer, reference_lexicon, policy_sentences, fusion):
    torch.manual_seed(0)
    config = policy_config(
        char_tokenizer,
        word_vocab_size=len(reference_lexicon),
        num_hidden_layers=3,
        num_word_layers=2,
        fusion_type=fusion,
    )
    model = PolicyBertForPreTraining(config).train()
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    batch = pretraining_batch(tokenizer, policy_sentences)
    assert (batch["labels"] != -100).sum() > 10
    out = model(**batch)
    assert out.mlm_loss is not None and out.nsp_loss is not None
    assert torch.allclose(out.loss, out.mlm_loss + out.nsp_loss)
    out.loss.backward()

    word_params = {
        name: p
        for name, p in model.named_parameters()
        if name.startswith(("bert.word_embeddings.", "bert.word_encoder.", "bert.fusions."))
    }
    fusion_params = [n for n in word_params if n.startswith("bert.fusions.")]
    if fusion == "none":
        assert not fusion_params, "ZEN addition has no parameters"
    else:
        assert fusion_params
    assert any(n.startswith("bert.word_encoder.1.") for n in word_params)
    for name, p in word_params.items():
        assert p.grad is not None, f"{name}: no gradient"
        assert p.grad.abs().sum() > 0, f"{name}: zero gradient"

    # Word embedding rows: the matched words get gradient, the padding row never does.
    emb_grad = model.bert.word_embeddings.word_embeddings.weight.grad
    used = batch["word_ids"][batch["word_attention_mask"].bool()].unique()
    assert (emb_grad[used].abs().sum(-1) > 0).all()
    assert emb_grad[0].abs().sum() == 0
    unused = torch.ones(len(emb_grad), dtype=torch.bool)
    unused[used] = False
    unused[0] = False
    assert emb_grad[unused].abs().sum() == 0


def test_mlm_decoder_is_tied_to_char_embeddings(char_tokenizer, reference_lexicon, policy_sentences, tmp_path):
    torch.manual_seed(0)
    model = PolicyBertForPreTraining(policy_config(char_tokenizer, word_vocab_size=len(reference_lexicon)))
    embeddings = model.bert.embeddings.word_embeddings.weight
    assert model.get_output_embeddings().weight is embeddings
    assert model.cls.predictions.decoder.weight.data_ptr() == embeddings.data_ptr()
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias

    # Still tied after a training step and a save/reload.
    batch = pretraining_batch(PolicyBertTokenizer(char_tokenizer, reference_lexicon), policy_sentences)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model(**batch).loss.backward()
    optimizer.step()
    assert torch.equal(model.cls.predictions.decoder.weight, model.bert.embeddings.word_embeddings.weight)
    model.save_pretrained(tmp_path)
    again = PolicyBertForPreTraining.from_pretrained(tmp_path)
    assert again.cls.predictions.decoder.weight is again.bert.embeddings.word_embeddings.weight
    assert torch.equal(again.bert.embeddings.word_embeddings.weight, embeddings)
    model.eval()
    again.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).prediction_logits, again(**batch).prediction_logits)


# --------------------------------------------------------------------------- heads, masks, segments


@pytest.mark.parametrize("fusion", FUSIONS)
def test_classifier_masks_and_segments_reach_the_model(char_tokenizer, reference_lexicon, policy_sentences, fusion):
    torch.manual_seed(0)
    config = policy_config(char_tokenizer, word_vocab_size=len(reference_lexicon), fusion_type=fusion, num_labels=2)
    model = PolicyBertForSequenceClassification(config).eval()
    tokenizer = PolicyBertTokenizer(char_tokenizer, reference_lexicon)
    a, b = policy_sentences[20:23], policy_sentences[30:33]
    batch = tokenizer(a, b)
    assert (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        logits = model(**batch).logits
        # Alone vs padded in a batch: padding never leaks into the pooled output.
        for i in range(3):
            alone = model(**tokenizer(a[i], b[i])).logits
            assert (alone - logits[i]).abs().max().item() <= TOL
        # Garbage in padded positions changes nothing.
        noisy = {k: v.clone() for k, v in batch.items()}
        pad = noisy["attention_mask"] == 0
        noisy["input_ids"][pad] = tokenizer.tokenizer.mask_token_id
        noisy["token_type_ids"][pad] = 1
        noisy["word_matching_matrix"][pad] = 1.0
        assert (model(**noisy).logits - logits).abs().max().item() <= TOL
        # Segment ids are used.
        flipped = dict(batch, token_type_ids=torch.zeros_like(batch["token_type_ids"]))
        assert (model(**flipped).logits - logits).abs().max().item() > 1e-4
    labelled = model(**batch, labels=torch.tensor([0, 1, 1]))
    assert labelled.loss is not None and labelled.loss.ndim == 0


def test_output_hidden_states(fusion_models, padded_texts):
    fusion, policy, _, tokenizer = fusion_models
    enc = tokenizer(padded_texts)
    with torch.no_grad():
        out = policy(**enc, output_hidden_states=True)
    assert len(out.hidden_states) == policy.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_late_layers_add_the_last_word_state(tiny_model_dir, policy_sentences, fusion):
    """Layers >= num_word_layers add M·W(last) (ZEN) with late_fusion='add', nothing with 'none'."""
    path = tiny_model_dir(fusion, perturb=True)  # 1 word layer under 2 character layers
    add = PolicyBertModel.from_pretrained(path).eval()
    assert add.config.late_fusion == "add" and add.config.num_word_layers < add.config.num_hidden_layers
    plain = PolicyBertModel(PolicyBertConfig(**{**add.config.to_dict(), "late_fusion": "none"})).eval()
    plain.load_state_dict(add.state_dict())
    tokenizer = PolicyBertTokenizer.from_pretrained(path)
    enc = tokenizer(policy_sentences[50])  # one example: no padding words, no padding chars
    assert enc["word_attention_mask"].all() and enc["word_attention_mask"].sum() > 2
    with torch.no_grad():
        with_add = add(**enc).last_hidden_state
        without = plain(**enc).last_hidden_state
        words = add.word_encoder[0](add.word_embeddings(enc["word_ids"]), None)
        words = words[0] if isinstance(words, tuple) else words
        expected = torch.bmm(enc["word_matching_matrix"], words)
    assert (with_add - without - expected).abs().max().item() <= 1e-5
    covered = enc["word_matching_matrix"].sum(-1) > 0
    assert (with_add - without)[~covered].abs().max().item() == 0.0
    assert (with_add - without)[covered].abs().max().item() > 1e-3
