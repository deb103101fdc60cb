import asyncio, time, grpc
opts=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
class S:
    async def gen(self, request, context):
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        state = {"n": 0, "t": time.monotonic()}
        def check():
            print("sent so far", state["n"])
            async def ab():
                try:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "client is not reading")
                except BaseException as e:
                    print("abort raised", type(e))
                print("abort returned")
                task.cancel()
            asyncio.ensure_future(ab())
        h = loop.call_later(2.0, check)
        try:
            for i in range(100000):
                yield b"x" * 30
                state["n"] = i
        finally:
            print("finally, sent", state["n"])
            h.cancel()
async def main():
    server = grpc.aio.server()
    s = S()
    handler = grpc.method_handlers_generic_handler("t.T", {"G": grpc.unary_stream_rpc_method_handler(s.gen)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
        call = ch.unary_stream("/t.T/G")(b"", timeout=20)
        it = call.__aiter__(); first = await it.__anext__()
        await asyncio.sleep(4)
        n = 1
        try:
            async for m in it:
                n += 1
        except grpc.RpcError as e:
            print("client got", n, e.code(), e.details())
        else:
            print("client ended ok", n, await call.code())
    await server.stop(0)
asyncio.run(main())
