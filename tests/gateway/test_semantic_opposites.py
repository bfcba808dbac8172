"""The opposites guard: its word lists, each hard-negative kind in each language through the match function, the
labelled set with the real embedder, and opposites through the live gateway."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gateway.layers.semantic.language import LanguageConfigError, check_languages
from gateway.layers.semantic.matching import DEFAULT_GUARDS, REASONS, SHIPPED_THRESHOLD, match, similarity
from gateway.layers.semantic.polarity import (
    DATA_FILE,
    LANGUAGES,
    LEXICON,
    OppositesDataError,
    facts,
    fold,
    fold_pattern,
    guard_opposites,
    load_lexicon,
    negation_count,
    swapped,
)
from tests.gateway.harness import call, chat

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ROOT / "bench" / "data" / "opposites_pairs.jsonl"


def _bench() -> ModuleType:
    """bench/semantic_precision.py as a module (bench/ is scripts, not a package)."""
    name = "bench_semantic_precision"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "semantic_precision.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


# --------------------------------------------------------------------------------------------------------------------
# The guard in the match function


def test_the_guard_is_a_default_guard_with_its_own_reason() -> None:
    assert DEFAULT_GUARDS == ("numbers", "negation", "opposites", "entities", "template")
    assert "guard_opposites" in REASONS
    verdict = match(
        "How do I sort the table in descending order?",
        "How do I sort the table in ascending order?",
        0.99,
        threshold=SHIPPED_THRESHOLD,
    )
    assert (verdict.hit, verdict.reason) == (False, "guard_opposites")


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        # sort order, in each language
        ("Sort the list in ascending order", "Sort the list in descending order", "guard_opposites"),
        ("Wie sortiere ich aufsteigend?", "Wie sortiere ich absteigend?", "guard_opposites"),
        ("Trier par ordre croissant", "Trier par ordre décroissant", "guard_opposites"),
        ("Ordenar de forma ascendente", "Ordenar de forma descendente", "guard_opposites"),
        ("按升序排列", "按降序排列", "guard_opposites"),
        # reversed comparisons; a comparison restated with the opposite comparative means the same
        ("Is Python faster than Java?", "Is Java faster than Python?", "guard_opposites"),
        ("Is a kilogram heavier than a pound?", "Is a pound lighter than a kilogram?", None),
        ("Ist Berlin größer als München?", "Ist München größer als Berlin?", "guard_opposites"),
        ("Lyon est-elle plus grande que Marseille ?", "Marseille est-elle plus grande que Lyon ?", "guard_opposites"),
        ("¿Es Rust más seguro que C++?", "¿Es C++ más seguro que Rust?", "guard_opposites"),
        ("北京比上海大吗", "上海比北京大吗", "guard_opposites"),
        ("猫比狗聪明吗？", "狗比猫聪明吗？", "guard_opposites"),  # one-character operands
        # directions: X to Y against Y to X, and a paraphrase of the same direction
        ("从北京到上海怎么走", "从上海到北京怎么走", "guard_opposites"),
        ("从北京到上海怎么走", "北京到上海怎么去", None),
        ("把英文翻译成中文", "把中文翻译成英文", "guard_opposites"),
        ("Wie rechne ich Celsius in Fahrenheit um?", "Wie rechne ich Fahrenheit in Celsius um?", "guard_opposites"),
        ("Convertir des euros en dollars", "Convertir des dollars en euros", "guard_opposites"),
        ("¿Cómo cambio euros a dólares?", "¿Cómo cambio dólares a euros?", "guard_opposites"),
        ("How do I rename a branch in git?", "What's the git command to rename a branch?", None),
        # time of day and direction words
        ("Der Zug fährt morgens", "Der Zug fährt abends", "guard_opposites"),
        ("The store opens at 9 am", "The store opens at 9 pm", "guard_opposites"),
        ("Pon una alarma a las 7 de la mañana", "Pon una alarma a las 7 de la tarde", "guard_opposites"),
        ("L'entrée ouest du stade est-elle ouverte ?", "L'entrée est du stade est-elle ouverte ?", "guard_opposites"),
        ("上铺对孩子安全吗？", "下铺对孩子安全吗？", "guard_opposites"),  # a bigram against its opposite twin
        # negation: parity per language, concord, yes/no questions and idioms that negate nothing
        ("Kann ich nicht zahlen?", "Kann ich zahlen?", "guard_opposites"),
        ("Ce n'est pas possible", "C'est possible", "guard_opposites"),
        ("Ce n'est pas possible", "Ce n'est jamais possible", None),
        ("No funciona nunca", "Nunca funciona", None),
        ("这个不能用", "这个能用", "guard_opposites"),
        ("能不能退款", "可以退款吗", None),
        ("这两个有什么不同", "这两个有什么区别", None),
        ("Which cheeses contain no lactose?", "Which cheeses don't contain lactose?", None),  # Spanish "no" is not read here
        # negating prefixes: an opposite, unless the other text negates too
        ("¿Cómo bloqueo la pantalla?", "¿Cómo desbloqueo la pantalla?", "guard_opposites"),
        ("Why am I unable to log in?", "Why am I not able to log in?", None),
        # one meaning over several pairs (rise/fall with up/down), and a German separable particle
        ("Pourquoi le cours a-t-il monté ?", "Pourquoi le cours a-t-il baissé ?", "guard_opposites"),
        ("Wie klappe ich alle Abschnitte ein?", "Wie klappe ich alle Abschnitte aus?", "guard_opposites"),
        # a word in two pairs counts in both (关闭: close and disable)
        ("如何开启两步验证？", "如何关闭两步验证？", "guard_opposites"),
    ],
)
def test_guard_opposites(a: str, b: str, reason: str | None) -> None:
    assert guard_opposites(a, b) == reason
    assert guard_opposites(b, a) == reason


def _labelled() -> list[Any]:
    return _bench().load_pairs(PAIRS)


def test_every_hard_negative_kind_in_every_language_is_refused_by_the_match_function() -> None:
    """All hard negatives of the labelled set, as if the embedder had put each pair at similarity 0.99."""
    bench = _bench()
    pairs = _labelled()
    served = [p.line for p in pairs if not p.hit and match(p.b, p.a, 0.99, threshold=SHIPPED_THRESHOLD).hit]
    assert served == []
    kinds = Counter((p.kind, p.lang) for p in pairs if not p.hit)
    assert {(k, lang) for k in bench.HARD_KINDS for lang in LANGUAGES} <= set(kinds)
    assert min(kinds.values()) >= 3
    # Without the opposites guard most of them would be served.
    without = [
        p for p in pairs if not p.hit and match(p.b, p.a, 0.99, threshold=SHIPPED_THRESHOLD, guards=bench.BASELINE_GUARDS).hit
    ]
    assert len(without) == 352  # of 408: the other guards alone refuse 56


def test_the_guard_refuses_no_paraphrase_of_the_labelled_set_but_two() -> None:
    """Positives include a synonym or a negation in both texts: the guard must not over-refuse them."""
    refused = [(p.a, p.b) for p in _labelled() if p.hit and guard_opposites(p.a, p.b) is not None]
    # Known blind spots: 重/轻 as bare one-character comparatives ("heavier" restated as "lighter") are not read, and
    # French "combien de X pour Y" reads as a direction from X to Y.
    assert refused == [
        ("一公斤比一磅重吗？", "一磅比一公斤轻吗？"),
        ("Convertir 100 dollars en yens", "Combien de yens pour 100 dollars ?"),
    ]


def test_labelled_set_make_up_and_bad_lines(tmp_path: Path) -> None:
    bench = _bench()
    pairs = _labelled()
    assert len(pairs) == 743
    assert sum(not p.hit for p in pairs) == 408
    assert Counter(p.batch for p in pairs) == {1: 413, 2: 180, 3: 150}
    bad = tmp_path / "pairs.jsonl"
    bad.write_text('# header\n{"a": "x", "b": "y", "label": "hit", "kind": "antonym", "lang": "en", "batch": 1}\n')
    with pytest.raises(bench.PairsError, match=r"pairs.jsonl:2.kind: must be one of paraphrase"):
        bench.load_pairs(bad)
    bad.write_text('{"a": "x", "b": "y", "label": "miss", "kind": "antonym", "lang": "it", "batch": 1}\n')
    with pytest.raises(bench.PairsError, match=r"pairs.jsonl:1.lang: must be one of en, de, fr, es, zh"):
        bench.load_pairs(bad)


@pytest.mark.slow
def test_precision_on_the_labelled_set_with_the_shipped_embedder() -> None:
    """Measured (bench/semantic_precision.py): precision 100.0 % (251/251), recall 74.9 %; without the opposites guard
    44.6 % (252 true, 313 false hits). The first run of each batch, before its misses were covered, is in the set's header."""
    from gateway.layers.semantic.embedder import Embedder

    bench = _bench()
    pairs = _labelled()
    embedder = Embedder()
    sims = bench.pair_similarities(pairs, embedder.embed)
    result = bench.evaluate(pairs, sims, embedder.embed)
    guarded, baseline = result["guarded"]["all"], result["baseline"]["all"]
    assert guarded["precision"] >= 0.99
    assert guarded["recall"] >= 0.7
    assert baseline["precision"] < 0.6
    for lang in LANGUAGES:
        assert result["guarded"]["by_lang"][lang]["precision"] >= 0.99, lang


@pytest.mark.slow
def test_precision_as_shipped_on_the_held_out_set() -> None:
    """The held-out set (bench/data/opposites_heldout.jsonl, written without reading the word lists) measured once
    with the guards alone: precision 87.2 % (23 false hits, all outside English), recall 62.3 %. As shipped, only
    questions in the embedder's language (English) are matched: precision 100 % (44/44), recall 17.5 % (English 86.3 %)."""
    from gateway.layers.semantic.embedder import Embedder

    bench = _bench()
    pairs = bench.load_pairs(ROOT / "bench" / "data" / "opposites_heldout.jsonl")
    embedder = Embedder()
    sims = bench.pair_similarities(pairs, embedder.embed)
    result = bench.evaluate(pairs, sims, embedder.embed, embedder.languages)
    shipped = result["shipped"]
    assert (shipped["all"]["false_hits"], shipped["all"]["true_hits"]) == (0, 44)
    assert shipped["by_lang"]["en"]["recall"] >= 0.85
    assert result["guarded"]["by_lang"]["en"]["false_hits"] == 0
    assert result["guarded"]["all"]["false_hits"] == 23


# --------------------------------------------------------------------------------------------------------------------
# The pieces


def test_fold_and_negation_count() -> None:
    assert fold("  Größer  ÉTÉ？ don’t ") == "grosser ete? don't"
    assert fold_pattern("größer\\w*") == "grosser\\w*"
    assert negation_count("Ich habe keine Zeit und nicht genug Geld") == 2
    assert negation_count("Ce n'est pas grave") == 1  # ne ... pas is one negation
    assert negation_count("C'est pas grave") == 1  # pas alone, where there is no ne
    assert negation_count("No funciona nunca") == 1
    assert negation_count("我没有收到，也不能登录") == 2
    assert negation_count("非常好，有什么不同？能不能退款？") == 0
    assert negation_count("I don't know, I can't say") == 2


def test_swapped_needs_an_operand_moved_each_way() -> None:
    a = ((frozenset({"celsius"}), frozenset({"fahrenheit"})),)
    b = ((frozenset({"fahrenheit"}), frozenset({"celsius"})),)
    c = ((frozenset({"celsius"}), frozenset({"fahrenheit", "please"})),)
    assert swapped(a, b) and swapped(b, a)
    assert not swapped(a, c)
    assert not swapped(a, ())


def test_every_literal_of_the_word_lists_is_found_in_a_text_made_of_it() -> None:
    """The index that reads a text word by word finds every listed word or phrase (none falls between its buckets)."""
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    missing = []
    for lang in LANGUAGES:
        for index, pair in enumerate(data["languages"][lang]["pairs"]):
            for side in pair["sides"]:
                for pattern in side:
                    if any(c in pattern for c in "\\[](){}?*+|^$") or pattern.endswith("."):
                        continue
                    if not facts(f"x {pattern} x").sides:
                        missing.append((lang, index, pattern))
    assert missing == []


def test_facts_are_cached_per_text() -> None:
    facts.cache_clear()
    guard_opposites("Sort ascending", "Sort descending")
    guard_opposites("Sort ascending", "Sort the other way")
    info = facts.cache_info()
    assert (info.hits, info.misses) == (1, 3)


def test_load_lexicon_refuses_a_bad_file(tmp_path: Path) -> None:
    with pytest.raises(OppositesDataError, match="opposites.json"):
        load_lexicon(tmp_path / "opposites.json")
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    del data["languages"]["zh"]
    (tmp_path / "a.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(OppositesDataError, match="languages must cover en, de, fr, es, zh"):
        load_lexicon(tmp_path / "a.json")
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    data["languages"]["de"]["pairs"][3]["sides"] = [["ok"]]
    (tmp_path / "b.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(OppositesDataError, match=r"languages.de.pairs\[3\].sides: must hold two sides"):
        load_lexicon(tmp_path / "b.json")
    data = json.loads(DATA_FILE.read_text(encoding="utf-8"))
    data["languages"]["fr"]["pairs"][0]["sides"][1].append("(unclosed")
    (tmp_path / "c.json").write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(OppositesDataError, match=r"languages.fr.pairs\[0\].sides\[1\]\[\d+\]: not a regular expression"):
        load_lexicon(tmp_path / "c.json")
    assert len(load_lexicon().kinds) == len(LEXICON.kinds)


# --------------------------------------------------------------------------------------------------------------------
# Through the live gateway (the real embedder and the deployment's entry store)


def _asked(content: str) -> dict[str, Any]:
    return chat(content, temperature=0, max_tokens=16)


@pytest.mark.django_db(transaction=True)
def test_the_gateway_serves_a_paraphrase_but_never_the_opposite(semantic_setup: dict[str, Any]) -> None:
    s = semantic_setup
    # The bundled embedder reads English only; the guards are shown on all five languages admitted.
    assert s["runtime"].semantic.languages == frozenset({"en"})
    s["runtime"].semantic.languages = check_languages(LANGUAGES)
    asked = [
        ("How do I sort the table in ascending order?", "engine"),
        ("How can I sort this table in ascending order?", "semantic"),
        ("How do I sort the table in descending order?", "engine"),
        ("Wie sortiere ich die Tabelle aufsteigend?", "engine"),
        ("Wie sortiere ich die Tabelle absteigend?", "engine"),
        ("Comment trier le tableau par ordre croissant ?", "engine"),
        ("Comment trier le tableau par ordre décroissant ?", "engine"),
        ("¿Es Python más rápido que Java?", "engine"),
        ("¿Es Java más rápido que Python?", "engine"),
        ("从北京到上海的最后一班火车是几点？", "engine"),
        ("从上海到北京的最后一班火车是几点？", "engine"),
    ]
    served = [call(s, _asked(text)).headers["x-kvcp-served-by"] for text, _ in asked]
    assert served == [where for _, where in asked]
    assert len(s["fake"].received) == 10
    # Each opposite is as close to a stored question as the paraphrase is: only the guard kept it from the cache.
    embed = s["runtime"].semantic.embedder.embed
    for first, second in ((0, 2), (3, 4), (5, 6), (7, 8), (9, 10)):
        vectors = embed([asked[first][0], asked[second][0]])
        assert similarity(vectors[0], vectors[1]) >= SHIPPED_THRESHOLD, asked[second][0]


@pytest.mark.django_db(transaction=True)
def test_questions_outside_the_embedders_languages_bypass_the_layer(semantic_setup: dict[str, Any]) -> None:
    """The bundled embedder reads English: a German, French, Spanish or Chinese question is
    never matched (its similarities mean nothing), whatever the guards would say; English is."""
    s = semantic_setup
    layer = s["runtime"].semantic
    assert layer.languages == frozenset({"en"})
    for text in ("Wie nehme ich schnell zu?", "Comment prendre du poids rapidement ?", "¿Cómo engordar de forma sana?",
                 "最便宜的机票怎么买？", "Vol Paris New York avec escale"):  # fmt: skip
        assert layer.admission(text, personal_data=False) == (False, "language_unsupported"), text
    for text in ("How do I gain weight quickly?", "Convert 100 US dollars to euros", "Is Python faster than Go?", "42 + 17"):
        assert layer.admission(text, personal_data=False)[1] != "language_unsupported", text
    # Personal data is still the reason reported first.
    assert layer.admission("Wie nehme ich schnell zu?", personal_data=True) == (False, "personal_data")
    # Through the gateway: a German paraphrase of a German question goes to the engine both times.
    served = [call(s, _asked(t)).headers["x-kvcp-served-by"] for t in ("Wie nehme ich schnell zu?", "Wie nehme ich rasch zu?")]
    assert served == ["engine", "engine"]


@pytest.mark.django_db(transaction=True)
def test_questions_resting_on_symbols_the_embedder_cannot_read_bypass_the_layer(semantic_setup: dict[str, Any]) -> None:
    """Emoji are one unknown token to the bundled embedder: 👍 and 👎 embed alike. A question holding
    one, or nothing but punctuation, is never matched; currency signs and arithmetic are read."""
    s = semantic_setup
    layer = s["runtime"].semantic
    embed = layer.embedder.embed
    vectors = embed(["Is this movie 👍 for kids?", "Is this movie 👎 for kids?"])
    assert similarity(vectors[0], vectors[1]) >= SHIPPED_THRESHOLD  # what the layer must not trust
    for text in ("🔑🔄❓", "🍕🍔🍟", "👍", "❤️ or 💔", "Is this movie 👍 for kids?", "???", "Set it to 50°F"):
        assert layer.admission(text, personal_data=False) == (False, "symbols_unsupported"), text
    for text in ("Convert 100 US dollars to €", "What is 2+2?", "How do I write a loop in C++ or C#?"):
        assert layer.admission(text, personal_data=False) == (True, "admitted"), text
    # Through the gateway: the second emoji question is computed, not served the first one's answer.
    served = [
        call(s, _asked(t)).headers["x-kvcp-served-by"] for t in ("Is this movie 👍 for kids?", "Is this movie 👎 for kids?")
    ]
    assert served == ["engine", "engine"]


def test_a_language_set_names_known_codes_only() -> None:
    assert check_languages(["en", "zh"]) == frozenset({"en", "zh"})
    for bad in ([], ["en", "xx"], ["EN"]):
        with pytest.raises(LanguageConfigError, match="non-empty subset of de, en, es, fr, it, nl, pt, zh"):
            check_languages(bad)
