"""Tools a model can call from inside an episode (``hybridrl.environments.tool_env``): the ``Tool`` contract
(``base``), the call parsers (``parsers``: Hermes/Qwen ``<tool_call>`` JSON built in, others by plugin), and the
built-in tools, ``calculator`` (``calculator``: arithmetic, never ``eval``) and ``python`` (``sandbox``:
model-written code in Linux namespaces through bubblewrap, with time, memory, process and output limits).
``toolbox`` builds the configured tools for a rollout and calls them under a deadline."""
