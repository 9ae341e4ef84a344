"""The exceptions that mean bad input or an unsuitable machine, not a bug in kvchat.

Front ends report these as one readable line (CLI: exit code 2; app: a notification) and
let anything else surface as the bug it is. Each of core's, and of the packages above it
(the client's ServerError), derives from UserError; config's and native's lie below core
and are named here.
"""

from __future__ import annotations

from kvchat.config import ConfigError
from kvchat.native.cpu import CpuLevelError


class UserError(Exception):
    """Bad input or an unsuitable machine, said in one line that names what to change."""


USER_ERRORS: tuple[type[Exception], ...] = (UserError, ConfigError, CpuLevelError)
