"""What every layer shares and nothing below it: value types (``model``), errors, the injected
clock, configuration, message ids, the field rules (``validate``), refusal counting, file helpers
(``fsutil``), the blocking-work contract (``jobs``) and the file makers' worker thread
(``batchworker``). Imports nothing else from chronoq."""
