"""What one request may bring: the documented bounds that keep its preparation linear and small.

Everything a request carries is checked against these before it reaches the scheduler, offline and in
the server alike, so that no single request can stall the step loop or hold unbounded memory. A value
over a limit is refused with an error naming the field and the limit (a 400 from the server).
"""

from __future__ import annotations

from .errors import InvalidRequestError

MAX_N = 256  # samples per request
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024  # each; matching rescans a window of the longest one every token
MAX_TOKEN_ID_LIST = 1 << 18  # stop_token_ids, allowed_token_ids, logit_bias entries
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 256
MAX_CHOICES = 1024  # structured_outputs.choice entries
MAX_GRAMMAR_CHARS = 256 * 1024  # a regex, EBNF grammar, JSON schema or structural tag, as text
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what a torch generator can be seeded with


def check_unicode(text: str, what: str) -> None:
    """InvalidRequestError for a string that has no UTF-8 form (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{what} is not valid Unicode: {e.reason} at character {e.start}") from None
