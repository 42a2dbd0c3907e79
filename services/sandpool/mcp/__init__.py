"""sandpool's sandboxes as Model Context Protocol tools: `/mcp` on the api (streamable HTTP, in process) and
`sandpool mcp` (stdio, over the Python client). Guide: docs/mcp.md."""
