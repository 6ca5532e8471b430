"""A second service on a taken port must fail to start (no silent SO_REUSEPORT sharing)."""
import asyncio

import pytest

from minedraft.serving import ServerOptions, build_server


def test_second_server_on_same_port_is_refused():
    async def scenario():
        first, _, port = await build_server(["minedraft.test"], ServerOptions(port=0))
        await first.start()
        try:
            with pytest.raises(RuntimeError, match="cannot bind"):
                await build_server(["minedraft.test"], ServerOptions(port=port))
        finally:
            await first.stop(None)

    asyncio.run(scenario())
