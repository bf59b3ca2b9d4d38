"""A real vLLM engine on math sets: the self-consistency eval (``math``:
``math.py`` parses and writes, ``runs.py`` runs, ``report.py`` scores and
tabulates) and the trace recorder (``record``) that shares its engine
(``llm.py``), datasets and prompts."""
