"""The ``autotune`` commands, one module each; ``autotune/cli.py`` is the group that registers
them. Beside them: ``options.py`` (the option blocks several commands share), ``output.py``
(what they print and write: the answer, the commands to type next), ``controller.py`` (the
loop that runs a study's trials). What a study is made of, from ``run``'s options, is
``autotune.plan`` (no click there)."""
