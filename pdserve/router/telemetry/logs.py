"""One log record, one line: whatever a client sent (paths, headers, ids, or the bytes the HTTP parser
quotes when it refuses a request) is escaped, so no request can forge or split log lines."""

from __future__ import annotations

import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def escape(text: str) -> str:
    """Control characters (newlines included) and backslashes as Python escapes; printable text as is."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


class OneLineFormatter(logging.Formatter):
    _second: tuple[int, str] = (-1, "")     # (a whole second of time.time(), its text without the msecs)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """logging's text for the time, its strftime made once a second rather than once a record (the
        access log writes a record a request). Seconds of the epoch are whole seconds of local time."""
        if datefmt is not None or self.converter is not time.localtime:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if self._second[0] != second:
            self._second = (second, time.strftime(self.default_time_format, time.localtime(second)))
        return self.default_msec_format % (self._second[1], record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        line = super().formatMessage(_with_message(record, self))
        if isinstance(exc, HttpProcessingError):
            # The parser refused a request: the reason is the news, not aiohttp's traceback.
            return f"{line}: {escape(type(exc).__name__ + ': ' + str(exc.message))}"
        if record.exc_info:
            line += " | " + escape(self.formatException(record.exc_info))
        return line


def _with_message(record: logging.LogRecord, formatter: logging.Formatter) -> logging.LogRecord:
    record.message = escape(record.getMessage())
    if formatter.usesTime():
        record.asctime = formatter.formatTime(record, formatter.datefmt)
    return record


def configure(level: int = logging.INFO) -> None:
    # A record a request (the access log, front/observe.py) costs less without what FORMAT never shows: the
    # caller's file and line (a walk up the stack), thread, process and task names (the logging HOWTO's
    # "Optimization").
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging.logAsyncioTasks = False
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])


def json_request_lines(name: str = "pdserve.router.requests") -> None:
    """The per-request JSON lines (router/telemetry/tracing.py) go out bare, one JSON object a line, for log shippers."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
