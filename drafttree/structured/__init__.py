"""Structured output: grammars (JSON schema, regex, choice, Lark/EBNF) compiled by llguidance,
one matcher per constrained request on the host, the constrained draft tree built from the
drafter's candidates along each path's grammar state, and the token masks the target's picks
take (`docs/design.md#structured-output`)."""
