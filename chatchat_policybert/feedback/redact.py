"""What a captured question loses before it is stored: Chinese ID-card numbers, mainland phone numbers, e-mail
addresses and bank-card numbers, each replaced by a placeholder (:data:`PLACEHOLDERS`).

Why at capture, not at export: a question is kept for months (the retention setting) in a file an operator reads, and
users paste what they ask about — their own ID card when they ask about a subsidy, a phone number when they ask who
to call. Nothing downstream needs those digits (a question about 身份证 still says 身份证 after redaction), and what
is never written cannot leak.

Why these rules, and what they leave alone (tests/core/test_redaction.py holds examples of both):

- **ID card** (居民身份证, GB 11643): 18 characters, 17 digits and a last digit or X, whose characters 7–14 are a
  birth date (19xx/20xx, a real month and day). The check digit is *not* required: a number typed with one wrong
  digit is still someone's. A date (20231231), a document number (国发〔2023〕12号) or an amount never has 18 digits
  with a date at that place.
- **Phone**: a mobile number (11 digits starting 13–19, optionally +86 / 0086 in front, optionally split 3-4-4 by
  spaces or hyphens) or a landline with its area code and a hyphen (010-62345678, 0755-8123456).
- **E-mail**: ``local@domain.tld``.
- **Bank card**: 13–19 digits (optionally in groups of four split by spaces or hyphens) whose Luhn check passes, not
  followed by a currency or unit (元, 万, 亿 …): an amount of 13 digits passes Luhn one time in ten.

Full-width digits and letters (１３８…, ＠), which Chinese input methods type, are matched as their ASCII forms; the
stored question keeps every other character as the user typed it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PLACEHOLDERS = {
    "id_card": "[身份证号]",
    "mobile": "[手机号]",
    "landline": "[电话号码]",
    "email": "[邮箱]",
    "bank_card": "[银行卡号]",
}
"""The kind of each redaction -> what replaces it in the stored question."""

# Full-width ASCII (U+FF01..U+FF5E) -> ASCII, one character for one: positions in the folded text are positions in the
# question, so a match found in the folded text is cut out of the original.
_FOLD = {code: code - 0xFEE0 for code in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
_ID_CARD = re.compile(
    r"(?<![0-9A-Za-z])[1-9]\d{5}(?:19|20)\d{2}(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx](?![0-9A-Za-z])"
)
_UNIT = r"(?!\s*(?:元|万|亿|千|百|块|角|分|美元|人民币|%|％|\.\d))"
_BANK_CARD = re.compile(r"(?<![\d.])(?:\d{4}(?:[ -]\d{4}){2,3}(?:[ -]\d{1,4})?|\d{13,19})(?!\d)" + _UNIT)
_MOBILE = re.compile(r"(?<![\d+])(?:(?:\+|00)86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")
_LANDLINE = re.compile(r"(?<![\d-])0\d{2,3}-[2-9]\d{6,7}(?![\d-])")


def _luhn(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _is_bank_card(match: str) -> bool:
    digits = re.sub(r"[ -]", "", match)
    return 13 <= len(digits) <= 19 and _luhn(digits)


_RULES: tuple[tuple[str, re.Pattern[str], Callable[[str], bool] | None], ...] = (
    ("email", _EMAIL, None),
    ("id_card", _ID_CARD, None),
    ("bank_card", _BANK_CARD, _is_bank_card),
    ("mobile", _MOBILE, None),
    ("landline", _LANDLINE, None),
)
"""In order: an e-mail first (its local part may hold digits), an ID card before a bank card (18 digits may pass
Luhn), a bank card before a phone (a card number holds 11-digit runs only inside longer ones, which the phone rule's
digit boundaries already refuse, but a card split in groups must go whole)."""


def redact(text: str) -> tuple[str, dict[str, int]]:
    """``text`` with each ID-card, phone, e-mail and bank-card number replaced by its placeholder, and how many of
    each kind were replaced (kinds with none left out)."""
    counts: dict[str, int] = {}
    for kind, pattern, accept in _RULES:
        folded = text.translate(_FOLD)
        pieces, last = [], 0
        for match in pattern.finditer(folded):
            if accept is not None and not accept(match.group()):
                continue
            pieces += [text[last : match.start()], PLACEHOLDERS[kind]]
            last = match.end()
            counts[kind] = counts.get(kind, 0) + 1
        if pieces:
            text = "".join(pieces) + text[last:]
    return text, counts
