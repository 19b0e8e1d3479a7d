"""docs/recipes.md: each recipe's command parses, resolves and passes train.py's checks, its memory block is
tools.memory's estimate and fits its card, a full fine-tune passes the refusal of what cannot fit, and the run
starts with the recipe's own flags through model loading on a stand-in of the model's widths and vocabulary (one
layer; no download)."""

import json
import re
from pathlib import Path

import pytest
import torch

import model as models
import train
from plumbing import flags
from tools import memory, recipes

PAGE = recipes.PAGE.read_text()
RECIPES = recipes.recipes(PAGE)


def test_the_page_has_its_recipes_and_is_current():
    assert [r.number for r in RECIPES] == [1, 2, 3, 4] and {r.card for r in RECIPES} == {24, 80}
    assert recipes.filled(PAGE) == PAGE, "run python -m tools.recipes"
    # and the rewrite finds every generated part: each memory block and the time table, made stale, come back
    stale = re.sub(r"(<!-- recipe-memory:\d -->\n).*?(```)", r"\1stale\n\2", PAGE, flags=re.S)
    stale = re.sub(r"(<!-- recipe-time -->\n).*?(?=\n## )", r"\1stale\n", stale, flags=re.S)
    assert stale.count("stale\n") == 5 and recipes.filled(stale) == PAGE


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: str(r.number))
def test_each_recipe_resolves_and_fits_its_card(recipe, tmp_path, monkeypatch):
    args, cfg = recipes.resolved(recipe.argv)
    flags.validate(args)  # every check train.py makes before loading (the hub dataset's name included)
    assert recipes.peak_gib(recipe) <= (1 - memory.MARGIN) * recipe.card
    if args.lora_rank:
        return
    # the refusal of a full fine-tune that cannot fit, on a config.json of the model's shape: passes on the card
    s = recipes.shape(args.model)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": s.hidden,
              "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
              "num_key_value_heads": s.kv // (s.hidden // s.heads), "vocab_size": s.vocab,
              "tie_word_embeddings": True}  # Qwen2.5 up to 3B ties the head to the embeddings
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert models.parameter_counts(str(tmp_path))[0] == pytest.approx(s.params, rel=0.01)
    for card, fits in ((recipe.card, True), (1, False), *(((24, False),) if recipe.card > 24 else ())):
        monkeypatch.setattr(models, "free_memory", lambda device, card=card: card * memory.GiB)
        if fits:
            models.refuse_what_cannot_fit(str(tmp_path), torch.device("cuda"), torch.bfloat16, cfg.beta > 0)
        else:
            with pytest.raises(models.ModelError, match="train LoRA adapters instead"):
                models.refuse_what_cannot_fit(str(tmp_path), torch.device("cuda"), torch.bfloat16, cfg.beta > 0)


class Started(Exception):
    pass


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """Per Qwen2.5 shape the recipes name: a random Qwen2 model built from its config (its widths, heads, vocabulary,
    tied head and context) with one layer instead of 24-28, and the embedded tokenizer with a chat template (the real
    tokenizer would need the hub). The layer count changes no flag's path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.initialization import no_init_weights

    from conftest import CHAT_TEMPLATE

    tok = models.build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    out = {}
    for model in sorted({recipes.resolved(r.argv)[0].model for r in RECIPES}):
        s = recipes.shape(model)
        config = Qwen2Config(
            hidden_size=s.hidden, intermediate_size=s.intermediate, num_hidden_layers=1, num_attention_heads=s.heads,
            num_key_value_heads=s.kv // (s.hidden // s.heads), vocab_size=s.vocab, tie_word_embeddings=True,
            max_position_embeddings=32768, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
            bos_token_id=tok.eos_token_id)
        with no_init_weights():  # zeros instead: starting needs the shapes, and a random init of 0.3B weights is slow
            policy = Qwen2ForCausalLM(config).to(torch.bfloat16)
        for p in policy.parameters():
            p.data.zero_()
        out[model] = tmp_path_factory.mktemp(s.name)
        policy.save_pretrained(out[model])
        tok.save_pretrained(out[model])
        del policy
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: str(r.number))
def test_each_recipe_starts_on_a_stand_in(recipe, tmp_path, monkeypatch, stand_ins):
    data = tmp_path / "gsm8k.jsonl"  # GSM8K's shape: a question, a worked answer ending in '#### n'
    data.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a in range(1, 9) for b in range(1, 9)))
    argv, skip = [], {"--model", "--dataset", "--dataset-config"}
    it = iter(recipe.argv)
    for word in it:
        if word in skip:
            next(it)
        else:
            argv.append(word)
    seen = {}

    def stop(*a, **kw):  # the first evaluation: everything before it has been built
        seen["policy"] = a[0]
        raise Started

    monkeypatch.setattr(train, "evaluate", stop)
    args, _ = recipes.resolved(recipe.argv)
    with pytest.raises(Started):
        train.main(argv + ["--model", str(stand_ins[args.model]), "--dataset", str(data),
                           "--output-dir", str(tmp_path / "runs"), "--wandb-mode", "disabled"])
    assert seen["policy"].config.vocab_size == recipes.shape(args.model).vocab
    trainable = [p for p in seen["policy"].parameters() if p.requires_grad]
    assert bool(args.lora_rank) == (len(trainable) < len(list(seen["policy"].parameters())))
    assert models.is_checkpointing(seen["policy"]) == args.gradient_checkpointing
