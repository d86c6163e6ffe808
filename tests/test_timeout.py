from datetime import timedelta

import pytest

from lightning_ddp_plus.config.timeout import DEFAULT_TIMEOUT, format_timeout, parse_timeout


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (1800, 1800),
        (12.5, 12.5),
        (timedelta(minutes=3), 180),
        ("90s", 90),
        ("30m", 1800),
        ("2h", 7200),
        ("1h30m", 5400),
        ("1d", 86400),
        ("1h 30m 15s", 5415),
        ("0:30:00", 1800),
        ("1:00:00", 3600),
        ("1 day, 0:00:00", 86400),
        ("2 days, 1:30:00", 2 * 86400 + 5400),
        ("3600", 3600),
        (None, DEFAULT_TIMEOUT.total_seconds()),
    ],
)
def test_accepted_forms(value, seconds):
    assert parse_timeout(value) == timedelta(seconds=seconds)


def test_default_is_thirty_minutes():
    assert DEFAULT_TIMEOUT == timedelta(minutes=30)


@pytest.mark.parametrize("value", [0, -5, "0s", timedelta(0), -0.1, float("inf"), float("nan")])
def test_non_positive_or_infinite_is_refused(value):
    with pytest.raises(ValueError, match=r"`timeout=.*greater than zero.*Fix:"):
        parse_timeout(value)


@pytest.mark.parametrize("value", ["soon", "30 minutes", "1h30", "-5m", "1:75:00", ""])
def test_unparseable_string_is_refused(value):
    with pytest.raises(ValueError, match=r"could not be read as a duration.*'1h30m'"):
        parse_timeout(value)


@pytest.mark.parametrize("value", [True, [30], {"minutes": 30}])
def test_wrong_type_is_refused(value):
    with pytest.raises(TypeError, match="timeout"):
        parse_timeout(value)


def test_format_round_trips():
    for text in ["45s", "1m30s", "30m", "1h30m", "1d", "2d3h"]:
        assert format_timeout(parse_timeout(text)) == text
