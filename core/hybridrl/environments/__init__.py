"""Episodes: multi-turn rollouts in which an environment answers each model turn (tool results, feedback),
and the one row per trajectory the trainer receives, trained on the model's own tokens only.

* ``base``: the contract (``Environment.reset/step``, ``StepResult``, ``ModelTurn``, ``EpisodeLimits``);
* ``single_turn``: the default environment, today's single generation;
* ``tool_env``: the tool-calling environment (``hybridrl.tools``: parsers, calculator, Python sandbox);
* ``chat``: messages -> tokens through the chat template (observations by the fixed-base method);
* ``runner``: plays the episodes next to the engine, per request or in batched rounds;
* ``trajectory``: a trajectory's tokens and masks, and the packed rows;
* ``spec``: what the driver sends the workers (from the ``environment`` config section);
* ``metrics``: what the driver logs of a batch of episodes.

Plugins register environments, tools and parsers in ``hybridrl_register_environments(registry)``
(``add_environment``, ``add_tool``, ``add_tool_parser``).
"""
