"""floor.py's empty gRPC server written with grpclib (pure-Python HTTP/2 on asyncio) instead of grpcio.

grpclib is not a dependency of mhaserve: floor.py starts this file with the Python in $GRPCLIB_PYTHON
(a virtual environment with `pip install grpclib`), for `python floor.py ROUNDS grpc-empty grpclib-empty`."""

import asyncio
import sys

from grpclib.const import Cardinality, Handler
from grpclib.encoding.base import CodecBase
from grpclib.server import Server


class Raw(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message, message_type):
        return message

    def decode(self, data, message_type):
        return data


PAYLOAD = b"x" * 1600


class S:
    async def m(self, stream):
        await stream.recv_message()
        await stream.send_message(PAYLOAD)

    def __mapping__(self):
        return {"/floor.Empty/Call": Handler(self.m, Cardinality.UNARY_UNARY, bytes, bytes)}


async def main(port):
    server = Server([S()], codec=Raw())
    await server.start("127.0.0.1", port)
    await server.wait_closed()


asyncio.run(main(int(sys.argv[1])))
