"""The filter-rule language over RedPajama-V2 quality signals: what it keeps, what it refuses."""

import pytest

from megazpp.errors import DataError
from megazpp.preprocess.signal_filter import DUPLICATE_RULE, DocumentFilter, FilterSpec, load_filter_file, parse_rule

SIGNALS = {
    "rps_doc_word_count": [[0, 120, 57.0]],
    "ccnet_perplexity": [[0, 120, 512.5]],
    "ccnet_bucket": [[0, 120, "head"]],
    "rps_lines_num_words": [[0, 40, 10], [41, 80, 2], [81, 120, 0]],
    "rps_doc_ml_palm_score": [[0, 120, None]],
    "rps_lines_empty": [],
}


@pytest.mark.parametrize(
    "rule, keep",
    [
        ("rps_doc_word_count >= 50", True),
        ("rps_doc_word_count >= 57.5", False),
        ("ccnet_perplexity < 600 and rps_doc_word_count > 100", False),
        ("ccnet_perplexity < 600 or rps_doc_word_count > 100", True),
        ("not (ccnet_perplexity < 600)", False),
        ("not not ccnet_perplexity<600", True),
        ("ccnet_bucket == 'head'", True),
        ('ccnet_bucket != "head"', False),
        ("sum(rps_lines_num_words) == 12", True),
        ("mean(rps_lines_num_words) == 4", True),
        ("min(rps_lines_num_words) == 0 and max(rps_lines_num_words) == 10", True),
        ("count(rps_lines_num_words) >= 3", True),
        ("count(rps_lines_empty) == 0 and sum(rps_lines_empty) == 0", True),
        ("-1.5e1 < rps_doc_word_count", True),
        ("rps_doc_word_count > 10 or rps_doc_ml_palm_score > 0.5", True),  # short-circuits past the null
    ],
)
def test_rules_evaluate(rule, keep):
    assert parse_rule(rule)(SIGNALS) is keep


@pytest.mark.parametrize(
    "rule",
    [
        "rps_doc_ml_palm_score > 0.5",  # null value (an English-only score on other text)
        "rps_doc_wordcount > 5",  # absent: a misspelt name
        "ccnet_bucket > 3",  # a string compared with a number
        "mean(rps_lines_empty) > 1",  # mean of no lines
        "rps_doc_word_count > 10 and rps_doc_ml_palm_score > 0.5",
    ],
)
def test_unevaluable_rules_drop_and_say_so(rule):
    f = DocumentFilter(FilterSpec((rule,)))
    assert f.first_failure(SIGNALS, is_duplicate=False) == (rule, True)


def test_first_failing_rule_is_charged_and_duplicates_come_first():
    f = DocumentFilter(
        FilterSpec(
            ("rps_doc_word_count >= 50", "ccnet_perplexity < 500", "ccnet_perplexity < 400"), drop_duplicates=True
        )
    )
    assert f.first_failure(SIGNALS, is_duplicate=False) == ("ccnet_perplexity < 500", False)
    assert f.first_failure(SIGNALS, is_duplicate=True) == (DUPLICATE_RULE, False)
    assert DocumentFilter(FilterSpec(("rps_doc_word_count >= 50",))).first_failure(SIGNALS, True) is None


@pytest.mark.parametrize(
    "rule, message",
    [
        ("", "empty rule at column 1"),
        ("rps_doc_word_count >=", "expected a number, a string or a signal name at the end"),
        ("rps_doc_word_count 50", "expected a comparison .* got '50' at column 20"),
        ("rps_doc_word_count >= 50 and", "expected a number, a string or a signal name at the end"),
        ("(rps_doc_word_count >= 50", r"expected \) at the end"),
        ("rps_doc_word_count >= 50)", r"unexpected '\)' at column 25"),
        ("__import__('os').system('x') > 0", r"unexpected character '\.' at column 17"),
        ("__import__('os') > 0", r"expected a comparison .* got '\(' at column 11"),
        ("rps_doc_word_count >= 50; rm", "unexpected character ';' at column 25"),
        ("rps_lines_num_words > 3", r"per-line signal; use it inside one of sum, mean, min, max, count\(\)"),
        ("mean(3) > 1", "expected a signal name, got '3' at column 6"),
        ("and > 1", "expected a number, a string or a signal name, got 'and' at column 1"),
    ],
)
def test_malformed_rules_are_refused_naming_rule_and_column(rule, message):
    with pytest.raises(DataError, match=message) as err:
        FilterSpec((rule,))
    assert repr(rule) in str(err.value)


def test_filter_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text("drop_duplicates: true\nrules:\n  - rps_doc_word_count >= 50\n  - ccnet_perplexity < 600\n")
    spec = load_filter_file(path)
    assert spec == FilterSpec(("rps_doc_word_count >= 50", "ccnet_perplexity < 600"), True)
    assert spec.describe() == f"{DUPLICATE_RULE}; rps_doc_word_count >= 50; ccnet_perplexity < 600"
    for text, message in [
        ("rules: rps_doc_word_count >= 50\n", "'rules' must be a list of strings"),
        ("rule: []\n", "expected a mapping with keys 'rules'"),
        ("drop_duplicates: yes please\n", "'drop_duplicates' must be true or false"),
        ("rules: [rps_doc_word_count >=]\n", "filter rule 'rps_doc_word_count >='"),
        ("rules: [\n", "cannot read"),
    ]:
        path.write_text(text)
        with pytest.raises(DataError, match=message):
            load_filter_file(path)
    with pytest.raises(DataError, match="missing.yaml: cannot read"):
        load_filter_file(tmp_path / "missing.yaml")
