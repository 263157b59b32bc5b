"""Tool calling on the chat route: tool_choice enforced through the structured-output engine."""
