"""The comparison job page: each prompt's answer without the cache and with it,
side by side and in full, marked from the first character where they differ."""

from __future__ import annotations

import pytest

from cacheadmin.models import ComparisonJob, ComparisonResult, Engine
from cacheadmin.templatetags.cacheadmin_tags import divergence_marked, text_divergence

POLICY = "You can return any unused item within "
REFERENCE = POLICY + "14 days of delivery for a full refund."
CACHED = POLICY + "30 days of delivery for a full refund."
HOURS = "Support answers 9:00-17:00 <b>weekdays</b> & never runs <script>alert(1)</script>"


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("same answer", "same answer", None),
        ("", "", None),
        ("", "x", 0),
        ("abc", "abcdef", 3),
        ("abcdef", "abc", 3),
        ("a", "b", 0),
        (REFERENCE, CACHED, len(POLICY)),
        ("Rückgabe in 14 Tagen", "Rückgabe in 30 Tagen", 12),
        ("退货期限为14天", "退货期限为30天", 5),
        ("👍 yes", "👍 no", 2),
        # A difference on a combining mark or inside an emoji sequence starts at its base character.
        ("cafe\u0301", "cafe\u0300", 3),
        ("cafe", "cafe\u0301", 3),
        ("👍\U0001f3fb", "👍\U0001f3ff", 0),
        ("x 👨\u200d👩", "x 👨\u200d👧", 2),
    ],
)
def test_text_divergence_is_the_first_differing_character(a: str, b: str, expected: int | None) -> None:
    assert text_divergence(a, b) == expected
    assert text_divergence(b, a) == expected


def test_divergence_marked_escapes_and_marks_from_the_difference_on() -> None:
    assert divergence_marked("a <b> 14", "a <b> 30") == 'a &lt;b&gt; <mark class="divergence">14</mark>'
    assert divergence_marked("<script>", "<script>") == "&lt;script&gt;"
    # The shorter text ends where the other goes on: an empty mark there.
    assert divergence_marked("abc", "abcdef") == 'abc<mark class="divergence"></mark>'
    assert divergence_marked("", "") == ""


@pytest.mark.django_db
def test_page_shows_both_answers_in_full_deceptive_first_and_marked(world: dict, admin_client) -> None:
    engine, ns = world["engine"], world["ns"]["acme"]
    reference = Engine.objects.create(name="e-ref", model_version=world["v1"], base_url="http://127.0.0.1:2", status="ready")
    job = ComparisonJob.objects.create(engine=engine, reference_engine=reference, namespace=ns, status="running")
    common = {"prompt_tokens": 40, "max_logprob_delta": 0.0, "control_tokens_equal": True, "control_max_logprob_delta": 0.0,
              "tolerance": 0.001, "ttft_cold_ms": 30.0, "ttft_warm_ms": 8.0}  # fmt: skip
    ComparisonResult.objects.create(
        job=job, index=0, conversation_id="hours", cached_tokens=32, tokens_equal=True, first_divergence=None,
        deceptive=False, reference_text=HOURS, cached_text=HOURS, **common,
    )  # fmt: skip
    ComparisonResult.objects.create(
        job=job, index=1, conversation_id="returns", cached_tokens=32, tokens_equal=False, first_divergence=7,
        deceptive=True, reference_text=REFERENCE, cached_text=CACHED, **common,
    )  # fmt: skip
    url = f"/comparison-jobs/{job.pk}/"
    page = admin_client.get(url).content.decode()
    # The numbers table keeps one row per prompt, in index order, the divergence as a 1-based token.
    assert page.index('<a href="#answer-0">0</a>') < page.index('<a href="#answer-1">1</a>')
    assert "<td>token 8</td>" in page and "<td>—</td>" in page
    assert (page.count("deceptive hit</td>"), page.count("correct hit</td>")) == (1, 1)
    # Answers: the deceptive hit first and open, the rest closed.
    assert page.index('<details id="answer-1" class="answer" open>') < page.index('<details id="answer-0" class="answer">')
    assert (
        '<summary class="unsafe">#1 conversation <code>returns</code>: deceptive hit, the texts differ, '
        "outputs diverge at token 8</summary>"
    ) in page
    # Both sides in full: the common prefix plain, the rest marked.
    assert (
        '<h3>Without cache (reference engine e-ref)</h3><div class="answer-text">'
        'You can return any unused item within <mark class="divergence">14 days of delivery for a full refund.</mark></div>'
    ) in page
    assert (
        "<h3>With cache (engine under test e-acme, namespace <code>acme000000000000</code>)</h3>"
        '<div class="answer-text">You can return any unused item within '
        '<mark class="divergence">30 days of delivery for a full refund.</mark></div>'
    ) in page
    assert page.count('<mark class="divergence">') == 2
    # Equal texts: said so, shown unmarked and escaped on both sides.
    assert "<summary>#0 conversation <code>hours</code>: correct hit, identical text</summary>" in page
    escaped = (
        '<div class="answer-text">Support answers 9:00-17:00 &lt;b&gt;weekdays&lt;/b&gt; &amp; never runs '
        "&lt;script&gt;alert(1)&lt;/script&gt;</div>"
    )
    assert page.count(escaped) == 2 and "<script>alert" not in page

    # While the job runs, the poll answers the fragment: the same answers, polling on.
    fragment = admin_client.get(url, headers={"HX-Request": "true"}).content.decode()
    assert fragment.startswith('<div id="job" hx-get="' + url + '" hx-trigger="every 2s')
    assert "<html" not in fragment and fragment.count('<mark class="divergence">') == 2
    ComparisonJob.objects.filter(pk=job.pk).update(status="succeeded")
    assert "hx-get" not in admin_client.get(url, headers={"HX-Request": "true"}).content.decode()
