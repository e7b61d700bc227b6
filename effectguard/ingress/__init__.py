"""The ways in: the ASGI proxy (``effectguard serve``), the httpx transports, and the
thin httpx2 adapter for SDKs built on httpx2. All go through one guard."""
