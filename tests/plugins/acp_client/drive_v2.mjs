// Drives `apprentice acp` with the current official ACP TypeScript SDK (2.x: the client app
// API that replaced ClientSideConnection) and prints what it saw as one JSON object.
// Usage: node drive_v2.mjs WORKSPACE -- COMMAND ARGS...
import { spawn } from "node:child_process";
import { Readable, Writable } from "node:stream";
import * as acp from "@agentclientprotocol/sdk";

const [workspace, dashdash, ...command] = process.argv.slice(2);
if (dashdash !== "--" || command.length === 0) throw new Error("usage: WORKSPACE -- COMMAND...");

const agentProcess = spawn(command[0], command.slice(1), { stdio: ["pipe", "pipe", "inherit"] });
const report = { updates: [], permissions: [] };

const app = acp.client({ name: "apprentice-test" })
  .onRequest(acp.methods.client.session.requestPermission, ({ params }) => {
    report.permissions.push(params.toolCall);
    const option = params.options.find((o) => o.kind === "allow_once");
    return { outcome: { outcome: "selected", optionId: option.optionId } };
  })
  .onNotification(acp.methods.client.session.update, ({ params }) => {
    report.updates.push(params.update);
  });

const stream = acp.ndJsonStream(Writable.toWeb(agentProcess.stdin), Readable.toWeb(agentProcess.stdout));

app.connectWith(stream, async (agent) => {
  report.initialize = await agent.request(acp.methods.agent.initialize, {
    protocolVersion: acp.PROTOCOL_VERSION, clientCapabilities: {},
  });
  const session = await agent.request(acp.methods.agent.session.new, { cwd: workspace, mcpServers: [] });
  report.prompt = await agent.request(acp.methods.agent.session.prompt, {
    sessionId: session.sessionId, prompt: [{ type: "text", text: "Fix add in calc.py" }],
  });
})
  .then(() => { process.stdout.write(JSON.stringify(report)); })
  .catch((error) => { report.error = String(error?.stack ?? JSON.stringify(error)); process.stdout.write(JSON.stringify(report)); process.exitCode = 1; })
  .finally(() => { agentProcess.stdin.end(); setTimeout(() => agentProcess.kill(), 2000).unref(); });
