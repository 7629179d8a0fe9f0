"""What every layer shares and nothing below it: value types (``model``), errors, the injected
clock, configuration, message ids, the field rules (``validate``), refusal counting, file helpers
(``fsutil``) and the blocking-work contract (``jobs``). Imports nothing else from chronoq."""
